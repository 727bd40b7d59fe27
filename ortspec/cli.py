"""ortspec: exact speculative decoding with MTP draft heads on ONNX Runtime.

Convert a HuggingFace Qwen3.5 checkpoint, then generate from it or benchmark it.
"ortspec COMMAND --help" lists a command's options; "python -m ortspec" runs the same.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from .errors import InputError, OrtspecError

EXAMPLES = """examples:
  ortspec convert models/qwen35-python-20m out/py20m
  ortspec verify out/py20m
  ortspec generate out/py20m --prompt "def fibonacci(n):" --max-new-tokens 64 -k 2
  ortspec bench out/py20m -k 0,1,2,3 --batch 1,4 --plot bench.png   (--plot needs: pip install 'ortspec[bench]')
  ortspec serve out/py20m -k 2 --port 8000                           (needs: pip install 'ortspec[serve]')
  ortspec serve out/py20m -k 2 --replicas 2 --threads 1              (needs: pip install 'ortspec[ray]')
"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks and appends each option's default to its help,
    except for flags and options whose default is "not set" (their help says what happens)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        unset = any(default is value for value in (None, False, argparse.SUPPRESS))  # `is`: 0 is a default
        if not action.option_strings or "default" in text or unset:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})"


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,1; got {text!r}")


def _batch_sizes(text: str) -> list[int]:
    """--batch of bench: comma-separated batch sizes, each >= 1."""
    sizes = _int_list(text)
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1 (requests decoded together), such as "
                                         f"1,4; got {text!r}")
    return sizes


def _count_or_auto(text: str, expected: str):
    """An integer option that also takes "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected {expected} or "auto"; got {text!r}')


def _k_or_auto(text: str):
    """-k of generate and serve: a count, or "auto" (the Session chooses k per step)."""
    return _count_or_auto(text, "an integer")


def parse_draft_vocab(text: str):
    """--draft-vocab: "auto" or a token count (0: none)."""
    return _count_or_auto(text, "a token count such as 32768, 0 for none,")


def _probability(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 <= p <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability between 0 and 1 such as 0.8; got {text!r}")
    return p


def _k_list(text: str) -> list:
    """-k of bench: comma-separated counts and "auto"."""
    return [_k_or_auto(x) for x in text.split(",")]


def _add_k(parser, help: str, type, default, old_spellings: tuple[str, ...], metavar: str = "K") -> None:
    """-k / --num-speculative-tokens, one spelling for every command; earlier spellings keep
    working (hidden from --help)."""
    parser.add_argument("-k", "--num-speculative-tokens", dest="k", metavar=metavar, type=type, default=default,
                        help=help)
    for spelling in old_spellings:
        parser.add_argument(spelling, dest="k", type=type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _add_run_options(parser, max_new_tokens: int) -> None:
    """Options of generate and bench: how the Session runs."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate per request")
    parser.add_argument("--commit", choices=["select", "readvance"], default="select",
                        help="how GDN states are committed after a verify (both exact)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu", help="ONNX Runtime execution provider")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's choice)")
    parser.add_argument("--pipeline-stages", type=int, default=1, help="run the target as N pipeline stages")
    parser.add_argument("--devices", type=_int_list, default=None,
                        help="GPU per pipeline stage, e.g. 0,1 (default: every stage on device 0)")
    _add_exact(parser)


def _add_exact(parser) -> None:
    """--exact and --exact-batch-size (generate, bench, serve)."""
    parser.add_argument("--exact", action="store_true",
                        help="exact mode: every step's target forward at one fixed shape, so on a GPU in "
                             "float16/bfloat16 too a token's bits depend on neither batch, row nor k "
                             "(costs K+1 rows per request per step; reserves K positions of max length)")
    parser.add_argument("--exact-batch-size", type=int, default=16,
                        help="with --exact: rows of the fixed shape (batches run in groups of it)")


def _command(sub, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A subcommand: `summary` in `ortspec --help`, `description` atop its own --help."""
    return sub.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter)


def _add_convert(sub) -> None:
    c = _command(sub, "convert", "HuggingFace Qwen3.5 checkpoint -> ONNX graphs + manifest.json",
                 "Converts a HuggingFace Qwen3.5-text checkpoint (config.json + *.safetensors,\n"
                 "mtp.* weights included) into ONNX graphs and manifest.json.")
    c.add_argument("checkpoint", help="directory with config.json and *.safetensors")
    c.add_argument("out", help="output directory")
    _add_k(c, "largest k (drafts per step) a Session of this model may use", int, 4, old_spellings=("-K",))
    c.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="dtype of the weight matrices and their products; states stay float32; "
                        "bfloat16 models run on the CUDA provider only")
    c.add_argument("--activations", choices=["auto", "float32", "model"], default="auto",
                   help="dtype between layers: auto (default: model unless int4 weights), float32, or model: the "
                        "model's float16/bfloat16 (the residual "
                        "stream and its norms in it, a Cast only into and out of the attention/GDN float32 insides; "
                        "fewer kernels per GPU step; not with int4)")
    c.add_argument("--max-length", type=int, default=1024, help="longest prompt + generated tokens")
    c.add_argument("--pipeline-stages", type=int, default=1, help="also write the target graphs split in N stages")
    c.add_argument("--quant", choices=["int4"], default=None,
                   help="int4 projection weights (MatMulNBits, blocks of 32; default: none)")
    c.add_argument("--mtp-quant", choices=["auto", "int4", "none"], default="auto",
                   help="the MTP draft head's weights: int4 (cheaper drafts; the output is the target's), none (the "
                        "model's dtype), or auto (default: int4 for a float32 model, none for float16/bfloat16)")
    c.add_argument("--gdn-verify", choices=["auto", "per_row", "state_window", "transition"], default="auto",
                   help="how the CUDA select verifies emit the GDN states for the commit: auto (default: "
                        "transition for float16/bfloat16, per_row for float32), per_row (the recurrence once per "
                        "row), state_window (the fused ops' own state windows; CUDA only, k <= 7) or transition "
                        "(the rows' transition record, replayed onto the state by one native kernel: the fastest "
                        "on the H200); the CPU variants run per row whatever it is")
    c.add_argument("--draft-vocab", type=parse_draft_vocab, default="auto", metavar="N",
                   help="the MTP head drafts from the N most frequent tokens only (its lm_head cut to N columns; "
                        "the output stays the target's): auto (default: 32768 for a vocabulary from 65536 up, "
                        "none below), N, or 0 for none")
    c.add_argument("--draft-corpus", metavar="FILE", default=None,
                   help="a text file whose token frequencies rank the draft vocabulary (needs tokenizer.json; "
                        "default: token ids rank it, a BPE vocabulary's merge order)")
    c.add_argument("--no-sampling-graphs", dest="sampling_graphs", action="store_false",
                   help="leave out decode_sample and verify_mtp_sample_k* (sampling on the device; a quicker "
                        "conversion of a model that only decodes greedily)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace an existing converted model in OUT whole (never a directory of other files)")
    c.set_defaults(func=_convert)


def _add_verify(sub) -> None:
    v = _command(sub, "verify", "check a converted model's files against their recorded sha256",
                 "Re-hashes every file of a converted model and compares sizes and sha256 with\n"
                 "manifest.json (exit 0: intact; 2: the first damaged file is named).")
    v.add_argument("model", help="converted model directory")
    v.set_defaults(func=_verify)


def _add_generate(sub) -> None:
    g = _command(sub, "generate", "greedy or speculative generation from a converted model",
                 "Generates from a converted model: the text (or token ids) on stdout,\n"
                 "tokens/s and acceptance on stderr.")
    g.add_argument("model", help="converted model directory")
    g.add_argument("--prompt", required=True, help="text (needs tokenizer.json) or token ids with --ids")
    g.add_argument("--ids", action="store_true", help="the prompt is token ids, e.g. '3 1 4' or 3,1,4")
    _add_k(g, 'MTP drafts per step (0 = plain greedy; "auto": chosen per step by measured speed)', _k_or_auto, 0,
           old_spellings=())
    _add_run_options(g, max_new_tokens=32)
    g.set_defaults(func=_generate)


def _add_bench(sub) -> None:
    b = _command(sub, "bench", "greedy vs speculative tokens/s, side by side in one run",
                 "Times greedy and speculative generation on the same prompts, interleaved, and\n"
                 "prints one table (tokens/s, ratio to greedy, acceptance, phase times).")
    b.add_argument("model", help="converted model directory, or a HuggingFace checkpoint (converted per --dtype)")
    b.add_argument("--dtype", type=lambda text: text.split(","), default=None, metavar="DTYPE,...",
                   help="with a checkpoint: comma-separated dtypes to convert and bench side by side "
                        "(float32, float16, bfloat16; default: float32)")
    _add_k(b, 'comma-separated k values to bench (0 = greedy; "auto": the Session chooses per step)', _k_list, [0, 1, 2, 3, 4], old_spellings=("--k",),
           metavar="K,K,...")
    b.add_argument("--batch", type=_batch_sizes, default=[1], metavar="B,B,...", help="comma-separated batch sizes")
    b.add_argument("--prompts", metavar="FILE", help="JSON list of prompt texts (default: the bench's own 8 code "
                                                     "prompts), e.g. benchmarks/heldout_prompts.json")
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is reported")
    b.add_argument("--scripted-drafts", type=_probability, metavar="P", default=None,
                   help="drafts right with probability P (each the greedy token, else that token + 1) instead "
                        "of the MTP head's, which still runs every step: a random-weight model at a real head's "
                        "acceptance (0.8: Qwen3.5's published MTP agreement)")
    _add_run_options(b, max_new_tokens=64)
    b.add_argument("--transformers", metavar="CHECKPOINT",
                   help="also time transformers' greedy generate on this HF checkpoint (same weights)")
    b.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    b.add_argument("--plot", metavar="FILE.png",
                   help="write a PNG plot here (tokens/s against k, one line per batch; needs matplotlib: "
                        "pip install 'ortspec[bench]')")
    b.set_defaults(func=_bench)


def _add_serve(sub) -> None:
    s = _command(sub, "serve", "an OpenAI-compatible HTTP server (needs: pip install 'ortspec[serve]')",
                 "Serves a converted model over HTTP: /v1/completions (and /v1/chat/completions when\n"
                 "tokenizer_config.json has a chat_template), server-sent-event streaming, /health and\n"
                 "/metrics, over one continuous batcher driven by one engine thread, in a process of its own\n"
                 "(--engine process, the default) or beside the HTTP server (--engine thread).\n"
                 "Limits (each below with its default): a request line and headers over 16 KiB get 431 (400\n"
                 "on h11, where httptools is not installed), idle keep-alive connections close after 5 s\n"
                 "(or --header-timeout, if shorter);\n"
                 "every option is checked before the model loads.")
    s.add_argument("model", help="converted model directory")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: one the OS picks)")
    _add_k(s, 'MTP drafts per step (0 = plain decoding; "auto": chosen per step by measured speed)', _k_or_auto, 0,
           old_spellings=())
    s.add_argument("--commit", choices=["select", "readvance"], default="select",
                   help="how GDN states are committed after a verify (both exact)")
    s.add_argument("--provider", choices=["cpu", "cuda"], default="cpu", help="ONNX Runtime execution provider")
    s.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's choice)")
    _add_exact(s)
    s.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (rows of the batch)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row before answering 429")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may wait and run (a body's 'timeout' may ask for less)")
    s.add_argument("--max-body-bytes", type=int, default=16 * 2**20, help="a larger request body gets 413")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="a longer text prompt (chat: the messages' contents) gets 413, before it is tokenized "
                        "(default: 4 x max_length x the longest token of the vocabulary: only a text that could "
                        "never fit is refused)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds to receive a whole body once its headers are in; then 408")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take, from opening or from its last response, to send a "
                        "request line and headers; then it is closed")
    s.add_argument("--send-timeout", type=float, default=30.0,
                   help="seconds a response may wait on a client that stops reading it (its socket's buffers "
                        "full); then the connection is dropped and its request cancelled")
    s.add_argument("--max-connections", type=int, default=None,
                   help="connections open at once; one more gets 503 as it opens and is closed (default: 4096, "
                        "or fewer where the file limit, ulimit -n, is under 2 x 4096 + 256)")
    s.add_argument("--prefill-thread", choices=["auto", "on", "off"], default="auto",
                   help="a joining request's prefill on a thread of its own while the running requests go on "
                        "(auto: on CUDA; on the CPU it spares the running requests a long prompt's prefill, at "
                        "the cost of that request's first token where the two share cores)")
    s.add_argument("--model-name", default=None, help="the model id the API reports (default: the directory's name)")
    s.add_argument("--engine", choices=["process", "thread"], default="process",
                   help="where the Session and its engine run: a child process, so the HTTP side's Python never "
                        "waits for the engine's (process; a child that dies is replaced), or a thread of this one")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="warning",
                   help="uvicorn's log level (info logs every request)")
    s.add_argument("--replicas", type=int, default=None,
                   help="serve N replicas on Ray Serve, each a Session of its own behind Serve's router: one GPU "
                        "each with --provider cuda, --threads CPU cores each (default 1) on the CPU (needs: pip "
                        "install 'ortspec[ray]')")
    s.add_argument("--ray-address", default=None,
                   help="with --replicas: a running Ray cluster to deploy on ('auto', or ray://HEAD:10001; "
                        "default: start a local one)")
    s.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortspec", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert(sub)
    _add_verify(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_serve(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except OrtspecError as exc:
        print(f"ortspec: error: {exc}", file=sys.stderr)
        return 2
    return 0


# -- commands ---------------------------------------------------------------------------------

def _convert(args) -> None:
    from .converter import convert

    out = convert(args.checkpoint, args.out, num_speculative_tokens=args.k, dtype=args.dtype,
                  max_length=args.max_length, pipeline_stages=args.pipeline_stages, quant=args.quant,
                  mtp_quant=args.mtp_quant, activations=args.activations, gdn_verify=args.gdn_verify,
                  draft_vocab=args.draft_vocab, draft_corpus=args.draft_corpus, sampling_graphs=args.sampling_graphs,
                  overwrite=args.overwrite)
    print(f"converted {args.checkpoint} -> {out}")


def _verify(args) -> None:
    from . import verify

    files = verify(args.model)
    print(f"{args.model}: {len(files)} files, {sum(files.values()) / 2**20:.1f} MiB: every size and sha256 matches "
          "manifest.json")


def _parse_prompt(text: str, ids: bool):
    if ids:
        try:
            return [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise InputError(f"--ids expects whitespace- or comma-separated integers such as '3 1 4', got {text!r}; "
                             "drop --ids to pass text.") from None
    return text


def accept_counts(histogram: list[int]) -> str:
    """'0: 5, 1: 6, 2: 16' from accept_histogram [5, 6, 16]: how many (row-)steps accepted 0, 1, 2 drafts."""
    return ", ".join(f"{length}: {count}" for length, count in enumerate(histogram))


def _generate(args) -> None:
    from .session import Session

    prompt = _parse_prompt(args.prompt, args.ids)  # before loading the model
    session = Session(args.model, provider=args.provider, num_speculative_tokens=args.k, commit=args.commit,
                      threads=args.threads, pipeline_stages=args.pipeline_stages, devices=args.devices,
                      exact=args.exact, exact_batch_size=args.exact_batch_size)
    start = time.perf_counter()
    out = session.generate(prompt, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - start
    print(prompt + out if isinstance(out, str) else " ".join(map(str, out)), flush=True)
    st = session.stats
    line = (f"[{st['generated_tokens']} tokens in {seconds:.3f} s: {st['generated_tokens'] / seconds:.1f} tokens/s"
            f" ({st['tokens_per_second']:.1f} tokens/s inside the decoder)")
    if session.auto_k:
        line += f"; auto k (up to {session.k}): steps by k {accept_counts(st['steps_by_k'])}"
    if session.k:
        line += (f"; k={'auto' if session.auto_k else session.k} {session.commit}: acceptance {st['acceptance_rate']:.2f}, "
                 f"{st['mean_tokens_per_step']:.2f} tokens/step, accept lengths (length: steps) "
                 f"{accept_counts(st['accept_histogram'])}")
    if session.exact:
        line += f"; exact mode: every forward {session.exact.batch_size} x {session.exact.k + 1} tokens"
    print(line + "]", file=sys.stderr)


def _bench(args) -> None:
    import tempfile
    from pathlib import Path

    from .bench import check_outputs, converted_models, format_table, merge_results, read_prompts, run_bench, write_outputs

    json_path, plot_path = (Path(p) if p else None for p in (args.json, args.plot))
    check_outputs(json_path, plot_path)  # before minutes of benchmarking, not after
    texts = read_prompts(args.prompts) if args.prompts else None
    with tempfile.TemporaryDirectory(prefix="ortspec-bench-") as workdir:
        models = converted_models(args.model, args.dtype, max(k if k != "auto" else 4 for k in args.k), Path(workdir), args.pipeline_stages)
        result = merge_results([run_bench(model, ks=args.k, batches=args.batch, max_new_tokens=args.max_new_tokens,
                                          repeats=args.repeats, provider=args.provider, commit=args.commit,
                                          threads=args.threads, pipeline_stages=args.pipeline_stages,
                                          devices=args.devices, prompt_texts=texts, exact=args.exact,
                                          exact_batch_size=args.exact_batch_size, scripted_p=args.scripted_drafts)
                                for model in models])
        if args.transformers:
            from .bench import transformers_greedy
            from .session import Session

            result["transformers"] = transformers_greedy(
                args.transformers, args.batch, args.max_new_tokens, args.repeats,
                device="cuda" if args.provider == "cuda" else "cpu", prompts_from=Session(models[0]),
                prompt_texts=texts)
    print(format_table(result))
    write_outputs(result, json_path, plot_path)


PREFILL_THREAD = {"auto": None, "on": True, "off": False}  # --prefill-thread -> Session(prefill_thread=...)


def _serve(args) -> None:
    from .serve.server import Server, check_options, require_dependencies
    from .session import Session

    require_dependencies()  # before loading the model
    limits = dict(request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
                  max_prompt_chars=args.max_prompt_chars, body_timeout=args.body_timeout,
                  header_timeout=args.header_timeout, send_timeout=args.send_timeout,
                  max_connections=args.max_connections)
    check_options(args.max_batch_size, args.max_queue, args.log_level, **limits)  # before loading the model too
    if args.replicas is not None:
        _serve_replicas(args, limits)
        return
    session_options = dict(provider=args.provider, num_speculative_tokens=args.k, commit=args.commit,
                           threads=args.threads, exact=args.exact, exact_batch_size=args.exact_batch_size,
                           prefill_thread=PREFILL_THREAD[args.prefill_thread])
    server_options = dict(host=args.host, port=args.port, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                          model_name=args.model_name, log_level=args.log_level, **limits)
    with contextlib.ExitStack() as stack:
        if args.engine == "process":
            server = Server.spawned(args.model, session_options, **server_options)
            k, auto_k = server.engine.ready.k, server.engine.ready.auto_k
        else:
            session = stack.enter_context(Session(args.model, **session_options))
            server = Server(session, **server_options)
            k, auto_k = session.k, session.auto_k
        print(f"ortspec serve: {server.url}/v1/completions (model {server.model_name!r}, "
              f"k={f'auto (up to {k})' if auto_k else k}, {args.provider}, batch {args.max_batch_size}, "
              f"queue {args.max_queue}, engine {args.engine}, {server.parser} on {server.loop}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        server.run()


def _serve_replicas(args, limits: dict) -> None:
    from .serve.ray import deploy, require_ray

    require_ray()
    served = deploy(args.model, replicas=args.replicas, host=args.host, port=args.port, address=args.ray_address,
                    provider=args.provider, threads=args.threads, num_speculative_tokens=args.k, commit=args.commit,
                    exact=args.exact, exact_batch_size=args.exact_batch_size, max_batch_size=args.max_batch_size,
                    max_queue=args.max_queue, model_name=args.model_name, log_level=args.log_level,
                    prefill_thread=PREFILL_THREAD[args.prefill_thread], **limits)
    print(f"ortspec serve: {served.url}/v1/completions on Ray Serve, {args.replicas} replicas ({args.provider}, "
          f"batch {args.max_batch_size} each); Ctrl-C stops", file=sys.stderr, flush=True)
    served.run()
