"""``ortspec bench``: greedy and speculative tokens/s side by side, in one run.

Every configuration (k, batch) runs the same prompts; runs are interleaved round-robin over
``--repeats`` rounds so machine noise hits all configurations alike, and each reports the
median. Ratios are against greedy (k=0) at the same batch size.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from tqdm.auto import tqdm

from .session import Session
from .speculative.drafts import MTPDrafts, ScriptedDrafts

PROMPT_TEXTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
                "for i in range(10):", "# Read the configuration file", "return sorted(items, key=lambda x:",
                "while True:\n    line = f.readline()", "with open(path) as f:"]


def _prompts(session: Session, batch: int, texts: list[str] | None = None) -> list[list[int]]:
    """batch prompts, cycling through texts (default PROMPT_TEXTS)."""
    texts = texts or PROMPT_TEXTS
    vocab = session.manifest.spec.vocab_size
    if session.manifest.tokenizer_path is not None:
        ids = [session.tokenizer.encode(t).ids for t in texts]
    else:
        ids = [[(7 * i + 3 * j) % vocab for j in range(8 + i)] for i in range(len(texts))]
    return [ids[i % len(ids)] for i in range(batch)]


def read_prompts(path) -> list[str]:
    """A JSON list of prompt texts (e.g. benchmarks/heldout_prompts.json)."""
    from .errors import InputError

    try:
        texts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"--prompts {path}: cannot read a JSON list of prompt texts ({exc}).") from exc
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise InputError(f"--prompts {path} must hold a non-empty JSON list of non-empty strings.")
    return texts


def scripted_drafts(truths: list[list[int]], vocab_size: int, p: float, seed: int):
    """make_drafts for one generate call whose row j holds the prompt of truths[j] (prompt + its
    plain-greedy continuation): each draft is the greedy token with probability p, else that
    token + 1 (ScriptedDrafts), so speculation runs at a set acceptance while the MTP head still
    runs every catch-up (a step costs what it would with a trained head). A placeholder row (a
    CUDA batch bucket's padding) is its own truth."""

    def truth(request) -> list[int]:
        return request.tokens if request.placeholder else truths[request.row]

    return lambda mtp: ScriptedDrafts(MTPDrafts(mtp), truth, vocab_size, p=p, seed=seed)


def greedy_truths(session: Session, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """prompt + plain greedy continuation per prompt (in one call of this batch size), K tokens
    longer than max_new_tokens (K: the conversion's largest k; a last step drafts past the end)."""
    longest = session.manifest.num_speculative_tokens
    outputs = session.generate(prompts, max_new_tokens=max_new_tokens + longest)
    return [list(p) + list(o) for p, o in zip(prompts, outputs)]


def run_bench(model_dir, ks=(0, 1, 2, 3, 4), batches=(1,), max_new_tokens=64, repeats=3, provider="cpu",
              commit="select", threads=None, progress=True, pipeline_stages=1, devices=None,
              prompt_texts: list[str] | None = None, exact=False, exact_batch_size=16,
              scripted_p: float | None = None) -> dict:
    """scripted_p: drafts right with this probability (scripted_drafts) instead of the head's own,
    for random-weight models whose heads never draft the target's tokens."""
    def session(k):
        return Session(model_dir, provider=provider, num_speculative_tokens=k, commit=commit, threads=threads,
                       pipeline_stages=pipeline_stages, devices=devices, exact=exact, exact_batch_size=exact_batch_size)

    sessions = {k: session(k) for k in ks}
    samples = {(k, b): [] for k in ks for b in batches}
    cpu = {key: [] for key in samples}  # process CPU time: with one intra-op thread, machine load barely moves it
    stats = {}
    options = _draft_options(lambda: sessions.get(0) or session(0), batches, max_new_tokens, prompt_texts, scripted_p)
    for k, b in samples:  # warm-up: first runs allocate and initialise; auto k climbs to its best k, a call a
        # window (speculative/auto_k.py), as a Session serving requests would have long before
        for _ in range(2 * sessions[k].k + 4 if k == "auto" else 1):
            sessions[k].generate(_prompts(sessions[k], b, prompt_texts), max_new_tokens=max_new_tokens if k == "auto"
                                 else 8, **options(k, b, 0))
    bar = tqdm(total=repeats * len(samples), desc="ortspec bench", disable=not progress)
    for r in range(repeats):
        for (k, b), times in samples.items():
            session = sessions[k]
            session.reset_stats()
            start, cpu_start = time.perf_counter(), time.process_time()
            session.generate(_prompts(session, b, prompt_texts), max_new_tokens=max_new_tokens, **options(k, b, r + 1))
            times.append(time.perf_counter() - start)
            cpu[(k, b)].append(time.process_time() - cpu_start)
            stats[(k, b)] = session.stats
            bar.update()
    bar.close()
    rows = []
    for (k, b), times in samples.items():
        seconds = statistics.median(times)
        st = stats[(k, b)]
        rows.append({
            "k": k, "batch": b, "tokens_per_second": b * max_new_tokens / seconds, "seconds": seconds,
            "repeat_seconds": list(times),
            "cpu_seconds": statistics.median(cpu[(k, b)]),
            "mean_tokens_per_step": st["mean_tokens_per_step"], "acceptance_rate": st["acceptance_rate"],
            "accept_histogram": st["accept_histogram"],
            "phase_ms": {p: 1000 * v for p, v in st["seconds"].items()},
            "steps": st["steps"], "decode_steps": st["decode_steps"], "speculative_steps": st["speculative_steps"],
            "fused_verify_steps": st["fused_verify_steps"],  # of those, run as one graph (verify_mtp_k{k})
            "pipelined_steps": st["pipelined_steps"],  # decode steps run a step ahead of the GPU (greedy, auto's k = 0)
            "steps_by_k": st["steps_by_k"],
            "graphs": st.get("graphs", {}),
        })
    greedy = {r["batch"]: r for r in rows if r["k"] == 0}
    dtype = sessions[ks[0]].manifest.dtype
    for r in rows:
        g = greedy.get(r["batch"])
        r["speedup_vs_greedy"] = r["tokens_per_second"] / g["tokens_per_second"] if g else None
        r["cpu_speedup_vs_greedy"] = g["cpu_seconds"] / r["cpu_seconds"] if g else None  # same tokens, less CPU time
        r["dtype"] = dtype
    exact_shape = sessions[ks[0]].exact
    return {"model": str(model_dir), "provider": provider, "commit": commit, "max_new_tokens": max_new_tokens,
            "repeats": repeats, "threads": threads, "pipeline_stages": pipeline_stages, "prompts": prompt_texts or "bench",
            "scripted_drafts": scripted_p,
            "devices": sessions[ks[0]].devices, "rows": rows,
            "exact": dataclasses.asdict(exact_shape) if exact_shape else None}


def _draft_options(greedy_session, batches, max_new_tokens: int, prompt_texts, scripted_p: float | None):
    """(k, batch, round) -> generate's extra options: none, or with scripted_p the scripted
    drafts of that batch's prompts (their truths from one call per batch size of the greedy
    Session ``greedy_session()`` returns; a seed per round)."""
    if scripted_p is None:
        return lambda k, b, r: {}
    greedy = greedy_session()
    truths = {b: greedy_truths(greedy, _prompts(greedy, b, prompt_texts), max_new_tokens) for b in batches}
    vocab = greedy.manifest.spec.vocab_size
    return lambda k, b, r: {} if k == 0 else {"make_drafts": scripted_drafts(truths[b], vocab, scripted_p, seed=r)}


def converted_models(model, dtypes: list[str] | None, num_speculative_tokens: int, workdir: Path,
                     pipeline_stages: int = 1) -> list[Path]:
    """The converted directories to bench: ``model`` itself when it is one (its dtype must be
    the one asked for), or ``model`` as a HuggingFace checkpoint converted once per dtype into
    workdir (default dtype float32)."""
    from .converter import convert
    from .errors import ConfigurationError
    from .manifest import Manifest

    model = Path(model)
    if (model / "manifest.json").exists():
        have = Manifest.load(model).dtype
        if dtypes and dtypes != [have]:
            raise ConfigurationError(
                f"{model} was converted with dtype {have}; --dtype {','.join(dtypes)} needs the checkpoint it came "
                f"from (ortspec bench CHECKPOINT --dtype ...), or drop --dtype."
            )
        return [model]
    return [convert(model, workdir / dtype, num_speculative_tokens=max(1, num_speculative_tokens), dtype=dtype,
                    pipeline_stages=pipeline_stages, progress=False) for dtype in (dtypes or ["float32"])]


def merge_results(results: list[dict]) -> dict:
    """One result over several dtypes: the first's settings, every run's rows (each carries its dtype)."""
    merged = dict(results[0])
    merged["rows"] = [row for result in results for row in result["rows"]]
    merged["dtypes"] = [result["rows"][0]["dtype"] for result in results]
    return merged


def transformers_greedy(checkpoint, batches=(1,), max_new_tokens=64, repeats=3, device="cpu", dtype="float32",
                        prompts_from=None, prompt_texts: list[str] | None = None) -> list[dict]:
    """transformers' own greedy generate on the same weights, for a side-by-side row (k = "hf").
    Prompts of a batch are left-padded to one length; tokens/s counts the new tokens."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(device).eval()
    rows = []
    for b in batches:
        prompts = _prompts(prompts_from, b, prompt_texts)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        rows.append({"k": "hf", "batch": b, "tokens_per_second": b * max_new_tokens / seconds, "seconds": seconds})
    return rows


def format_table(result: dict) -> str:
    """Markdown table; a dtype column when the result spans several dtypes ("vs greedy" is
    against greedy of the same dtype and batch; the transformers row against the first dtype)."""
    several = len({r.get("dtype") for r in result["rows"]}) > 1
    lead = "| dtype " if several else ""
    lines = [lead + "| k | batch | tokens/s | vs greedy | tokens/step | acceptance | propose ms | verify ms | commit ms "
             "| decode ms | prefill ms |", ("|---" if several else "") + "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("transformers", []):
        greedy = next((g for g in result["rows"] if g["k"] == 0 and g["batch"] == r["batch"]), None)
        ratio = f"{r['tokens_per_second'] / greedy['tokens_per_second']:.2f}x" if greedy else "-"
        lines.append(("| - " if several else "") + f"| transformers generate | {r['batch']} | "
                     f"{r['tokens_per_second']:.1f} | {ratio} | 1.00 | - | - | - | - | - | - |")
    for r in result["rows"]:
        ph = r["phase_ms"]
        ratio = f"{r['speedup_vs_greedy']:.2f}x" if r["speedup_vs_greedy"] else "-"
        k = r["k"] if r["k"] != "auto" else "auto (steps by k: " + "/".join(map(str, r["steps_by_k"])) + ")"
        lines.append((f"| {r['dtype']} " if several else "") + f"| {k} | {r['batch']} | "
                     f"{r['tokens_per_second']:.1f} | {ratio} | "
                     f"{r['mean_tokens_per_step']:.2f} | {r['acceptance_rate']:.2f} | {ph['propose']:.1f} | "
                     f"{ph['verify']:.1f} | {ph['commit']:.1f} | {ph['decode']:.1f} | {ph.get('prefill', 0.0):.1f} |")
    return "\n".join(lines)


def check_outputs(json_path: Path | None, plot_path: Path | None) -> None:
    """Fails before any benchmarking if an output cannot be written: a missing directory, or
    --plot without matplotlib (a long run that ends without its plot is the worse outcome)."""
    from .bench_plot import require_matplotlib
    from .errors import InputError

    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None and not path.parent.is_dir():
            raise InputError(f"{flag} {path}: the directory {path.parent} does not exist; create it or write "
                             "elsewhere.")
    if plot_path is not None:
        require_matplotlib()


def write_outputs(result: dict, json_path: Path | None, plot_path: Path | None) -> None:
    """The JSON (written whole, through a temporary file) and the plot (ortspec/bench_plot.py)."""
    if json_path:
        partial = json_path.with_name(json_path.name + ".partial")
        partial.write_text(json.dumps(result, indent=1))
        partial.replace(json_path)
    if plot_path:
        from .bench_plot import write_plot

        write_plot(result, plot_path)
