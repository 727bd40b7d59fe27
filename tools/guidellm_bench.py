"""`ortspec serve` loaded by guidellm (vLLM's server load tool), k against k in one run.

    python3 tools/guidellm_bench.py MODEL_DIR -k 0,2,auto --concurrency 1,4,8 [--rate R] --threads 1
        --guidellm /tmp/glenv/bin/guidellm --json F

Per k, a server in a child process (tools/serve_load.py's `served`), warmed up, then guidellm over
/v1/completions, streamed, with the prompts of --prompts and --output-tokens per request: a
concurrency sweep, then (server restarted) one constant rate, by default half the lowest k's best
sweep requests/s. Reported from guidellm's JSON report per benchmark: requests/s, output tokens/s,
TTFT, ITL and request latency p50/p95, completed / incomplete / errored, and `short` (completed
requests with fewer than --output-tokens tokens: guidellm sends `ignore_eos`, which the server has
served since c7f40e1 (session 7), so a nonzero count means a request stopped early).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.serve_bench import shown  # noqa: E402
from tools.serve_load import run_clients, served  # noqa: E402

DEFAULT_PROMPTS = ROOT / "benchmarks" / "heldout_prompts.json"
BUSY = ("ortspec bench", "serve_bench")  # other benchmarks this one must not share the CPU with


def scenario(url: str, prompts: list[str], output_tokens: int, profile: dict, max_seconds: float,
             tokenizer: str, report: Path, rows: int) -> dict:
    """A guidellm scenario (`guidellm run -c FILE`): the prompts in turn, `rows` requests' worth,
    each with an output token count (guidellm then sends it as max_tokens, with ignore_eos)."""
    texts = [prompts[i % len(prompts)] for i in range(rows)]
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "request_format": "/v1/completions", "stream": True},
        "profile": profile,
        "data": [{"kind": "in_memory_dict", "data": {"prompt": texts, "output_tokens_count": [output_tokens] * rows}}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "constraints": [{"kind": "max_duration", "seconds": max_seconds}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}


def _stat(metrics: dict, name: str, status: str, key: str):
    """One number of a guidellm distribution summary: metrics[name][status] `mean` or a percentile `p50`."""
    summary = (metrics.get(name) or {}).get(status)
    if not summary or not summary.get("count"):
        return None
    return summary["percentiles"][key] if key.startswith("p") else summary[key]


def label(strategy: dict) -> str:
    kind = strategy["type_"]
    if kind == "concurrent":
        return f"concurrent@{strategy['streams']}"
    if "rate" in strategy:
        return f"{kind}@{strategy['rate']:.2f}"
    return kind


def rows_of(report: dict, k, output_tokens: int) -> list[dict]:
    """One row per benchmark of a guidellm JSON report."""
    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        totals = m["request_totals"]
        done = bench["requests"]["successful"]
        strategy = bench["config"]["strategy"]
        rows.append({
            "k": k, "benchmark": label(strategy), "strategy": strategy["type_"],
            "streams": strategy.get("streams"), "rate": strategy.get("rate"),
            "seconds": bench["duration"],
            "completed": totals["successful"], "incomplete": totals["incomplete"], "errors": totals["errored"],
            "requests_per_second": _stat(m, "requests_per_second", "total", "mean"),
            "output_tokens_per_second": _stat(m, "output_tokens_per_second", "total", "mean"),
            "concurrency_mean": _stat(m, "request_concurrency", "total", "mean"),
            "ttft_p50_ms": _stat(m, "time_to_first_token_ms", "successful", "p50"),
            "ttft_p95_ms": _stat(m, "time_to_first_token_ms", "successful", "p95"),
            "itl_p50_ms": _stat(m, "inter_token_latency_ms", "successful", "p50"),
            "itl_p95_ms": _stat(m, "inter_token_latency_ms", "successful", "p95"),
            "latency_p50_s": _stat(m, "request_latency", "successful", "p50"),
            "latency_p95_s": _stat(m, "request_latency", "successful", "p95"),
            "output_tokens_mean": _stat(m, "output_token_count", "successful", "mean"),
            # completed requests that ended before output_tokens (ignore_eos is served: expected 0)
            "short": sum(1 for r in done if (r["output_metrics"].get("text_tokens") or 0) < output_tokens),
            "warnings": [w["code"] for w in bench.get("warnings") or []],
        })
    return rows


def request_keys(report: dict) -> list[str]:
    """The body fields guidellm sent, from the first recorded request."""
    for bench in report["benchmarks"]:
        for status in ("successful", "incomplete", "errored"):
            for request in bench["requests"].get(status) or []:
                return sorted(json.loads(request["request_args"])["body"])
    return []


def _f(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value, base) -> str:
    return "-" if not value or not base else f"{value / base:.2f}"


def format_table(rows: list[dict]) -> str:
    """Markdown; the ratio columns are each row over the row of the same benchmark at the first k."""
    base = {}
    for r in rows:
        base.setdefault(r["benchmark"], r)
    lines = ["| k | benchmark | req/s | output tok/s | TTFT p50 / p95 ms | ITL p50 / p95 ms | latency p50 / p95 s "
             "| done / incomplete / errors | short | tok/s ÷ first k | latency p50 ÷ first k |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[r["benchmark"]]
        lines.append(
            f"| {r['k']} | {r['benchmark']} | {_f(r['requests_per_second'], 2)} "
            f"| {_f(r['output_tokens_per_second'], 1)} | {_f(r['ttft_p50_ms'], 1)} / {_f(r['ttft_p95_ms'], 1)} "
            f"| {_f(r['itl_p50_ms'], 2)} / {_f(r['itl_p95_ms'], 2)} "
            f"| {_f(r['latency_p50_s'], 3)} / {_f(r['latency_p95_s'], 3)} "
            f"| {r['completed']} / {r['incomplete']} / {r['errors']} | {r['short']} "
            f"| {_ratio(r['output_tokens_per_second'], b['output_tokens_per_second'])} "
            f"| {_ratio(r['latency_p50_s'], b['latency_p50_s'])} |")
    return "\n".join(lines)


def constant_rate(sweep: list[dict]) -> float:
    """Half the lowest k's highest requests/s over the sweep (rounded down to 0.01)."""
    best = {}
    for r in sweep:
        best[r["k"]] = max(best.get(r["k"], 0.0), r["requests_per_second"] or 0.0)
    rate = math.floor(50 * min(best.values())) / 100
    if rate <= 0:
        raise SystemExit(f"guidellm_bench: no throughput measured to choose a rate from: {best}")
    return rate


def wait_quiet(timeout: float, poll: float = 10.0) -> float:
    """Wait until no process matches BUSY; returns the seconds waited."""
    start = time.monotonic()
    while True:
        busy = [p for p in BUSY if subprocess.run(["pgrep", "-f", p], capture_output=True).returncode == 0]
        if not busy:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise SystemExit(f"guidellm_bench: still running after {timeout:.0f} s: {busy}")
        print(f"guidellm_bench: waiting for {busy} to finish", file=sys.stderr, flush=True)
        time.sleep(poll)


def run_guidellm(guidellm: str, spec: dict, workdir: Path, name: str, quiet_timeout: float, workers: int) -> dict:
    path = workdir / f"{name}.scenario.json"
    path.write_text(json.dumps(spec))
    report = Path(spec["spec"]["outputs"][0]["path"])
    wait_quiet(quiet_timeout)
    # guidellm starts a worker process per concurrent stream (up to 10, and 10 for a rate): on a small
    # machine they take the server's cores, so --workers caps them (each runs its requests async)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               GUIDELLM__MAX_WORKER_PROCESSES=str(workers))
    with open(workdir / f"{name}.log", "w") as log:
        done = subprocess.run([guidellm, "run", "-c", str(path), "--disable-console-interactive"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    if done.returncode != 0 or not report.exists():
        tail = (workdir / f"{name}.log").read_text()[-4000:]
        raise SystemExit(f"guidellm_bench: guidellm failed ({done.returncode}) on {name}:\n{tail}")
    return json.loads(report.read_text())


def warm_up(url: str, prompts: list[str], output_tokens: int) -> None:
    """Each prompt once, two clients, streamed: graph sessions, arenas, auto k's first windows."""
    bodies = [[{"prompt": p, "max_tokens": output_tokens, "stream": True} for p in prompts[c::2]] for c in range(2)]
    results, _ = run_clients(url, bodies)
    failed = [r for rs in results for r in rs if r.status != 200 or r.error]
    if failed:
        raise SystemExit(f"guidellm_bench: the warm-up failed: {failed[0]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a converted model directory")
    parser.add_argument("-k", default="0,2", help="comma-separated k or auto (the first is the ratios' baseline)")
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--concurrency", default="1,4,8", help="the sweep's concurrent clients")
    parser.add_argument("--rate", type=float, help="the constant rate, requests/s (default: half the measured)")
    parser.add_argument("--max-seconds", type=float, default=25.0, help="each benchmark's duration")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="a JSON list of texts")
    parser.add_argument("--tokenizer", help="for guidellm's token counts (default: the model directory)")
    parser.add_argument("--guidellm", default=shutil.which("guidellm") or "/tmp/glenv/bin/guidellm")
    parser.add_argument("--workers", type=int, default=1, help="guidellm's worker processes at most")
    parser.add_argument("--quiet-timeout", type=float, default=1800.0,
                        help="seconds to wait for other benchmarks before giving up")
    parser.add_argument("--reports", type=Path, help="keep guidellm's scenarios, logs and reports here")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not Path(args.guidellm).exists():
        raise SystemExit(f"guidellm_bench: no guidellm at {args.guidellm} (pass --guidellm)")
    ks = [k if k == "auto" else int(k) for k in args.k.split(",")]
    streams = [int(c) for c in args.concurrency.split(",")]
    prompts = json.loads(args.prompts.read_text())
    tokenizer = args.tokenizer or str(args.model.resolve())
    rows_per_run = len(prompts) * math.ceil(2000 / len(prompts))  # more than any benchmark here sends
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    workdir = Path(args.reports or tempfile.mkdtemp(prefix="guidellm_bench_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    sent, version, sweep, constant = [], None, [], []

    def measure(k, name: str, profile: dict) -> list[dict]:
        nonlocal sent, version
        with served(args.model, k, args.provider, args.threads, args.max_batch_size) as url:
            warm_up(url, prompts, args.output_tokens)
            spec = scenario(url, prompts, args.output_tokens, profile, args.max_seconds, tokenizer,
                            workdir / f"{name}.report.json", rows_per_run)
            report = run_guidellm(args.guidellm, spec, workdir, name, args.quiet_timeout, args.workers)
        version = report["metadata"]["guidellm_version"]
        sent = sent or request_keys(report)
        rows = rows_of(report, k, args.output_tokens)
        print(format_table(rows), flush=True)
        return rows

    for k in ks:
        sweep += measure(k, f"k{k}_sweep", {"kind": "concurrent", "streams": streams})
    rate = args.rate or constant_rate(sweep)
    for k in ks:
        constant += measure(k, f"k{k}_constant", {"kind": "constant", "rate": [rate]})
    rows = sorted(sweep + constant, key=lambda r: (r["strategy"] != "concurrent", r["streams"] or 0, ks.index(r["k"])))
    table = format_table(rows)
    print(f"\ncommit {commit}, guidellm {version}, {args.model.name}, threads {args.threads}, "
          f"batch {args.max_batch_size}, {args.output_tokens} output tokens, {args.max_seconds:g} s per benchmark\n")
    print(table)
    if args.json:
        settings = {"commit": commit, "model": str(args.model), "k": ks, "provider": args.provider,
                    "threads": args.threads, "max_batch_size": args.max_batch_size, "concurrency": streams,
                    "rate": rate, "rate_chosen": "given" if args.rate else "half the lowest k's highest sweep req/s",
                    "max_seconds": args.max_seconds, "output_tokens": args.output_tokens,
                    "prompts": shown(args.prompts), "prompt_count": len(prompts), "tokenizer": tokenizer,
                    "guidellm_version": version, "guidellm_workers": args.workers, "request_body_fields": sent,
                    "cpus": os.cpu_count(),
                    "wall_seconds": round(time.time() - start, 1), "command": " ".join(sys.argv)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": settings, "rows": rows, "table": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
