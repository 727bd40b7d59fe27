"""Command line: ``ortspec convert`` and ``ortspec generate`` (also ``python -m ortspec``)."""

from __future__ import annotations

import argparse
import sys
import time

from .errors import OrtspecError


def _convert(args) -> None:
    from .converter import convert

    out = convert(args.checkpoint, args.out, num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype,
                  max_length=args.max_length, pipeline_stages=args.pipeline_stages, quant=args.quant,
                  mtp_quant=args.mtp_quant)
    print(f"converted {args.checkpoint} -> {out}")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,1; got {text!r}")


def _parse_prompt(text: str, ids: bool):
    if ids:
        try:
            return [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise SystemExit(f"--ids expects whitespace- or comma-separated integers, got {text!r}")
    return text


def _generate(args) -> None:
    from .session import Session

    session = Session(args.model, provider=args.provider, num_speculative_tokens=args.num_speculative_tokens,
                      commit=args.commit, threads=args.threads, pipeline_stages=args.pipeline_stages,
                      devices=args.devices)
    prompt = _parse_prompt(args.prompt, args.ids)
    start = time.perf_counter()
    out = session.generate(prompt, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - start
    print(prompt + out if isinstance(out, str) else " ".join(map(str, out)), flush=True)
    st = session.stats
    line = (f"[{st['generated_tokens']} tokens in {seconds:.3f} s: {st['generated_tokens'] / seconds:.1f} tokens/s"
            f" (decode only: {st['tokens_per_second']:.1f} tokens/s)")
    if session.k:
        line += (f"; k={session.k} {session.commit}: acceptance {st['acceptance_rate']:.2f}, "
                 f"{st['mean_tokens_per_step']:.2f} tokens/step, accept lengths {st['accept_histogram']}")
    print(line + "]", file=sys.stderr)


def _bench(args) -> None:
    import tempfile
    from pathlib import Path

    from .bench import converted_models, format_table, merge_results, read_prompts, run_bench, write_outputs

    texts = read_prompts(args.prompts) if args.prompts else None
    with tempfile.TemporaryDirectory(prefix="ortspec-bench-") as workdir:
        models = converted_models(args.model, args.dtype, max(args.k), Path(workdir), args.pipeline_stages)
        result = merge_results([run_bench(model, ks=args.k, batches=args.batch, max_new_tokens=args.max_new_tokens,
                                          repeats=args.repeats, provider=args.provider, commit=args.commit,
                                          threads=args.threads, pipeline_stages=args.pipeline_stages,
                                          devices=args.devices, prompt_texts=texts) for model in models])
        if args.transformers:
            from .bench import transformers_greedy
            from .session import Session

            result["transformers"] = transformers_greedy(
                args.transformers, args.batch, args.max_new_tokens, args.repeats,
                device="cuda" if args.provider == "cuda" else "cpu", prompts_from=Session(models[0]), prompt_texts=texts)
    print(format_table(result))
    write_outputs(result, Path(args.json) if args.json else None, Path(args.plot) if args.plot else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="HuggingFace Qwen3.5-text checkpoint -> ONNX graphs + manifest.json")
    c.add_argument("checkpoint", help="directory with config.json and *.safetensors")
    c.add_argument("out", help="output directory")
    c.add_argument("--num-speculative-tokens", "-K", type=int, default=4, help="largest k a Session may use (default 4)")
    c.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="matrix weights and products (states stay fp32; bfloat16 needs --provider cuda)")
    c.add_argument("--max-length", type=int, default=1024, help="longest prompt + generation (default 1024)")
    c.add_argument("--pipeline-stages", type=int, default=1, help="also write the target graphs split in N stages")
    c.add_argument("--quant", choices=["int4"], default=None, help="int4 projection weights (MatMulNBits, block 32)")
    c.add_argument("--mtp-quant", choices=["int4"], default=None,
                   help="int4 weights for the MTP draft head only (cheaper drafts; the output is the target's)")
    c.set_defaults(func=_convert)

    g = sub.add_parser("generate", help="generate from a converted model")
    g.add_argument("model", help="converted model directory")
    g.add_argument("--prompt", required=True, help="text (needs tokenizer.json) or token ids with --ids")
    g.add_argument("--ids", action="store_true", help="the prompt is token ids")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=0, help="MTP drafts per step (0 = greedy)")
    g.add_argument("--commit", choices=["select", "readvance"], default="select")
    g.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    g.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's)")
    g.add_argument("--pipeline-stages", type=int, default=1, help="run the target as N pipeline stages")
    g.add_argument("--devices", type=_int_list, default=None, help="device per stage, e.g. 0,1 (default: all on 0)")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="greedy vs speculative tokens/s, side by side in one run")
    b.add_argument("model", help="converted model directory, or a HuggingFace checkpoint (converted per --dtype)")
    b.add_argument("--dtype", type=lambda text: text.split(","), default=None,
                   help="with a checkpoint: comma-separated dtypes to convert and bench side by side "
                        "(float32, float16, bfloat16; default float32)")
    b.add_argument("--k", type=_int_list, default=[0, 1, 2, 3, 4], help="comma-separated k values (0 = greedy)")
    b.add_argument("--batch", type=_int_list, default=[1], help="comma-separated batch sizes")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--prompts", metavar="FILE", help="JSON list of prompt texts (default: the bench's own 8 code "
                                                     "prompts), e.g. benchmarks/heldout_prompts.json")
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is reported")
    b.add_argument("--commit", choices=["select", "readvance"], default="select")
    b.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--pipeline-stages", type=int, default=1, help="run the target as N pipeline stages")
    b.add_argument("--devices", type=_int_list, default=None, help="device per stage, e.g. 0,1 (default: all on 0)")
    b.add_argument("--transformers", metavar="CHECKPOINT",
                   help="also time transformers' greedy generate on this HF checkpoint (same weights)")
    b.add_argument("--json", help="write the results as JSON here")
    b.add_argument("--plot", help="write a PNG plot (tokens/s against k, one line per batch) here")
    b.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except OrtspecError as exc:
        print(f"ortspec: error: {exc}", file=sys.stderr)
        return 2
    return 0
