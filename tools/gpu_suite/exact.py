"""Exact mode on the GPU: requests that differ from greedy at batch 1, and what exact mode costs.

Converts --checkpoint (default the trained 20M model) once per --dtypes, then for exact mode
(Session(exact=True), every forward at [--exact-batch-size, K+1]) and for the default mode:
greedy over the held-out prompts (tools/gpu_suite/exact_prompts.py) at batch 1 is that mode's
reference; greedy at the other --batches, every k of --ks x --commits at every batch, and a
staggered-arrival batcher (k = max --ks, each commit, max --batches rows) are compared with
it, request by request. Exact mode must differ on 0 requests (exit status 1 otherwise, or if
any target forward ran at another shape: CUDA-graph slots); the default mode's rates are
reported. tokens/s of every run come from the same runs (after a warm-up call per batch size);
the cost of exact mode is exact / default at batch 1 and 16, greedy and best k (select).

--budget-s stops cleanly between generate calls and reports what each run covered. Runs go
exact mode first (every dtype), then the default mode. A rough runtime on an H200 for the
20M model (0.85 ms per decode step, ~1.5 ms per 16x5 verify, ~2.5 tokens per step) is
printed first: the full size (256 prompts x 256 tokens, k 1..4 x both commits, batch
1/4/16, fp16 and bf16) is about 75 minutes, most of it at batch 1; a reduced run such as
--prompts 48 --new-tokens 128 --ks 1,3 --commits select --batches 1,16 about 2 minutes.
--provider cpu runs the same logic on the CPU (tiny sizes; tests/test_gpu_tools.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import ortspec
from ortspec.speculative.batcher import run_arrivals

from .common import TRAINED, Budget, convert, markdown_table, write_json
from .exact_prompts import token_prompts

SUMMARY = "exact mode (fp16/bf16): requests differing from greedy at batch 1, its cost in tokens/s"
MODES = ("exact", "default")


def _list(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", default=str(TRAINED), help="HuggingFace checkpoint to convert")
    parser.add_argument("--out", default="/tmp/ortspec_gpu_exact", help="working directory (converted models)")
    parser.add_argument("--provider", choices=["cuda", "cpu"], default="cuda", help="cpu: the logic, tiny sizes")
    parser.add_argument("--dtypes", type=_list(str), default=["float16", "bfloat16"], help="dtypes to convert")
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--batches", type=_list(int), default=[1, 4, 16], help="batch sizes (1 is the reference)")
    parser.add_argument("--ks", type=_list(int), default=[1, 2, 3, 4], help="speculative k values")
    parser.add_argument("--commits", type=_list(str), default=["select", "readvance"], help="commit strategies")
    parser.add_argument("--exact-batch-size", type=int, default=16, help="rows of exact mode's fixed shape")
    parser.add_argument("--budget-s", type=float, default=0, help="stop starting work after this many seconds "
                                                                  "(0: no limit)")


def estimate_seconds(args) -> float:
    """A rough H200 runtime for the 20M model (module docstring): steps x seconds per step."""
    per_mode = 0.0
    for b in args.batches:
        calls = -(-args.prompts // b)
        per_mode += calls * args.new_tokens * 0.00085  # greedy
        spec_step = 0.0015 + 0.0005  # verify + the MTP head's catch-up
        for commit in args.commits:
            per_mode += len(args.ks) * calls * args.new_tokens / 2.5 * spec_step * (1.6 if commit == "readvance" else 1)
    per_mode += len(args.commits) * -(-args.prompts // 16) * args.new_tokens / 2.5 * 0.002  # batcher
    return per_mode * len(args.dtypes) * 2 * 1.4  # both modes; exact steps cost more (16 x (K+1) rows)


def run(args) -> int:
    if args.prompts < 1 or args.new_tokens < 1 or 1 not in args.batches:
        raise SystemExit("--prompts and --new-tokens must be >= 1 and --batches must include 1 (the reference)")
    print(f"rough runtime on an H200 (20M model): {estimate_seconds(args) / 60:.0f} min", flush=True)
    budget, out = Budget(args.budget_s), Path(args.out)
    results = {"settings": {k: v for k, v in vars(args).items() if k != "run"}, "runs": [], "stopped": None}
    models = {dtype: convert(args.checkpoint, out / dtype, dtype=dtype, max_length=args.new_tokens + 160)
              for dtype in args.dtypes}
    references = {(mode, dtype): check_mode(models[dtype], dtype, mode, args, budget, results)
                  for mode in MODES for dtype in args.dtypes}
    results["exact_vs_default_greedy"] = {dtype: sum(a != b for a, b in zip(references["exact", dtype],
                                                                            references["default", dtype]))
                                          for dtype in args.dtypes}  # informative: another shape, other roundings
    results["stopped"] = "budget" if budget.spent() else None
    results["cost"] = cost(results["runs"])
    failures = sum(r["differ"] + r.get("shape_violations", 0) for r in results["runs"] if r["mode"] == "exact")
    results["exact_failures"] = failures
    write_json(args.json, results)
    report(results)
    return 1 if failures else 0


def check_mode(model: Path, dtype: str, mode: str, args, budget: Budget, results: dict) -> list[list[int]]:
    """Greedy at batch 1 (the reference, returned), then every other configuration against it."""
    options = dict(provider=args.provider, exact=mode == "exact", exact_batch_size=args.exact_batch_size)
    with ortspec.Session(model, **options) as greedy:
        prompts = token_prompts(greedy, args.prompts)
        label = dict(dtype=dtype, mode=mode)
        reference = timed_runs(greedy, prompts, args.new_tokens, 1, budget, None, results, k=0, commit="-", **label)
        for b in [b for b in args.batches if b != 1]:
            timed_runs(greedy, prompts, args.new_tokens, b, budget, reference, results, k=0, commit="-", **label)
    for commit in args.commits:
        for k in args.ks:
            with ortspec.Session(model, num_speculative_tokens=k, commit=commit, **options) as session:
                for b in args.batches:
                    timed_runs(session, prompts, args.new_tokens, b, budget, reference, results, k=k, commit=commit,
                               **label)
        with ortspec.Session(model, num_speculative_tokens=max(args.ks), commit=commit, **options) as session:
            batcher_run(session, prompts, args, budget, reference, results, **label)
    return reference


def timed_runs(session, prompts, new_tokens, batch, budget, reference, results, **label) -> list[list[int]]:
    """Generate calls of `batch` prompts until all ran or the budget is spent; one row in results."""
    outputs, seconds = [], 0.0
    if not budget.spent():
        session.generate(prompts[:batch], max_new_tokens=8)  # warm-up: graphs captured, sessions built
    for start in range(0, len(prompts), batch):
        if budget.spent():
            break
        begin = time.perf_counter()
        outputs += session.generate(prompts[start: start + batch], max_new_tokens=new_tokens)
        seconds += time.perf_counter() - begin
    record(results, session, outputs, reference, seconds, batch=batch, **label)
    return outputs


def batcher_run(session, prompts, args, budget, reference, results, **label) -> None:
    if budget.spent():
        return
    rows = max(args.batches)
    begin = time.perf_counter()
    with session.batcher(max_batch_size=rows) as batcher:
        outputs = run_arrivals(batcher, [(p, args.new_tokens) for p in prompts])
    record(results, session, outputs, reference, time.perf_counter() - begin, batch=f"batcher {rows}",
           k=session.k, commit=session.commit, **label)


def record(results, session, outputs, reference, seconds, **row) -> None:
    """One row: requests run, how many differ from the reference (its own first requests), tokens/s."""
    compared = outputs if reference is None else outputs[: len(reference)]  # a budget may cut either short
    differ = 0 if reference is None else sum(a != b for a, b in zip(compared, reference))
    tokens = sum(len(o) for o in outputs)
    row.update(requests=len(compared), differ=differ, tokens_per_second=round(tokens / seconds, 1) if seconds else None)
    if session.exact:
        row["shape_violations"] = len(shape_violations(session))
    results["runs"].append(row)
    print(f"{row['dtype']} {row['mode']} k={row['k']} {row['commit']} b={row['batch']}: {row['requests']} "
          f"requests, {differ} differ from greedy at batch 1, {row['tokens_per_second']} tokens/s", flush=True)


def shape_violations(session) -> list[str]:
    """Captured target slots at any shape but exact mode's one (CUDA; on the CPU there are none:
    tests/test_exact_mode.py checks the shapes there with a spy)."""
    shape = session.exact
    fixed = f"{shape.graph}/M{shape.k + 1}/B{shape.batch_size}/"
    return [slot for slot in session.stats["graphs"] if not slot.startswith(("mtp", fixed))]


def cost(runs: list[dict]) -> list[dict]:
    """Exact / default tokens/s at batch 1 and 16 (those run), greedy and best k (select), per dtype."""
    rows = []
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        for batch in (1, 16):
            rate = {}
            for mode in MODES:
                mine = [r for r in runs if (r["dtype"], r["mode"], r["batch"]) == (dtype, mode, batch)
                        and r["tokens_per_second"]]
                rate[mode, "greedy"] = next((r["tokens_per_second"] for r in mine if r["k"] == 0), None)
                rate[mode, "best k"] = max((r["tokens_per_second"] for r in mine if r["commit"] == "select"),
                                           default=None)
            for what in ("greedy", "best k"):
                exact, default = rate["exact", what], rate["default", what]
                if exact and default:
                    rows.append(dict(dtype=dtype, batch=batch, run=what, exact=exact, default=default,
                                     exact_over_default=round(exact / default, 3)))
    return rows


def report(results: dict) -> None:
    for c in results["cost"]:
        print(f"cost {c['dtype']} batch {c['batch']} {c['run']}: exact {c['exact']} vs default {c['default']} "
              f"tokens/s ({c['exact_over_default']:.2f}x)")
    for dtype, differ in results["exact_vs_default_greedy"].items():
        print(f"{dtype}: exact greedy differs from default greedy (batch 1) on {differ} requests (other shapes, "
              "other roundings: both are greedy of that dtype)")
    print(f"exact mode: {results['exact_failures']} failures (differing requests + forwards at another shape)"
          + ("; stopped by --budget-s, see 'requests' for what each run covered" if results["stopped"] else ""))
    header = ["dtype", "mode", "k", "commit", "batch", "requests", "differ from greedy b1", "tokens/s"]
    print(markdown_table(header, [[r["dtype"], r["mode"], r["k"], r["commit"], r["batch"], r["requests"],
                                   r["differ"], r["tokens_per_second"]] for r in results["runs"]]))
