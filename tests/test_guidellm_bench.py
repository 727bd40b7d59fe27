"""tools/guidellm_bench.py without guidellm: its reading of guidellm's JSON report, on a report
written by hand in the layout guidellm 0.8.1 writes (`guidellm run ... --output kind=json`): per
benchmark `config.strategy`, `duration`, `metrics.<name>.<status>` distribution summaries
(mean, median, ..., `percentiles.p50`), `metrics.request_totals`, `requests.<status>` with each
request's `request_args` (the body sent, as JSON text) and `output_metrics`, and `warnings`.
"""

from __future__ import annotations

import json

import pytest

from tools.guidellm_bench import constant_rate, format_table, request_keys, rows_of, scenario

STATUSES = ("successful", "errored", "incomplete", "total")


def dist(mean=0.0, p50=0.0, p95=0.0, count=1) -> dict:
    """A guidellm DistributionSummary as it serializes (the fields the tool reads are mean, count, p50, p95)."""
    names = ("p001", "p01", "p05", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "p999")
    percentiles = {n: (p50 if n <= "p50" else p95) for n in names}
    percentiles.update(p50=p50, p95=p95)
    return {"mean": mean, "median": p50, "mode": p50, "variance": 0.0, "std_dev": 0.0, "min": 0.0, "max": p95,
            "count": count, "total_sum": mean * count, "percentiles": percentiles, "pdf": None, "mean_ci": None,
            "percentile_cis": None}


def by_status(**summaries) -> dict:
    """metrics.<name>: one summary per status; those not given are empty (count 0), as guidellm writes them."""
    return {s: summaries.get(s, dist(count=0)) for s in STATUSES}


def request(tokens, body=None) -> dict:
    body = body or {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 128,
                    "ignore_eos": True, "prompt": "def f():"}
    return {"type_": "generative_request_stats", "request_args": json.dumps({"method": None, "stream": True,
                                                                             "body": body}),
            "output_metrics": {"text_tokens": tokens, "text_words": 3}, "output": "x"}


def benchmark(strategy: dict, done: list, incomplete: int = 0, errored: int = 0, ttft=(30.0, 60.0),
              rps_total=2.5, tok_total=300.0) -> dict:
    n = len(done)
    metrics = {
        "request_totals": {"successful": n, "errored": errored, "incomplete": incomplete,
                           "total": n + errored + incomplete},
        # successful and total differ on purpose: throughput is read from total, latency from successful
        "requests_per_second": by_status(successful=dist(rps_total - 0.5, count=n), total=dist(rps_total, count=n)),
        "output_tokens_per_second": by_status(successful=dist(tok_total - 10, count=9),
                                              total=dist(tok_total, count=9)),
        "request_concurrency": by_status(total=dist(3.9, count=n)),
        "time_to_first_token_ms": by_status(successful=dist(40.0, *ttft, count=n), total=dist(1.0, 2.0, 3.0)),
        "inter_token_latency_ms": by_status(successful=dist(3.3, 3.2, 3.6, count=n)),
        "request_latency": by_status(successful=dist(0.4, 0.45, 0.5, count=n), total=dist(9.0, 9.0, 9.0)),
        "output_token_count": by_status(successful=dist(sum(done) / n if n else 0.0, count=n)),
    }
    if not n:
        metrics = {**metrics, **{name: by_status() for name in ("time_to_first_token_ms", "inter_token_latency_ms",
                                                                "request_latency", "output_token_count")}}
    return {"type_": "generative_benchmark", "config": {"strategy": strategy}, "duration": 25.0, "metrics": metrics,
            "requests": {"successful": [request(t) for t in done], "errored": [], "incomplete": [request(None)],
                         "total": None},
            "warnings": [{"code": "generation_delay_ttft", "message": "...", "observed": 0.03}]}


REPORT = {
    "metadata": {"version": 2, "guidellm_version": "0.8.1"},
    "benchmarks": [
        benchmark({"type_": "concurrent", "worker_count": 1, "max_concurrency": 1, "streams": 1}, [128, 128, 1]),
        benchmark({"type_": "concurrent", "worker_count": 1, "max_concurrency": 8, "streams": 8}, [128] * 4,
                  incomplete=8, errored=1, rps_total=5.0, tok_total=640.0),
        benchmark({"type_": "constant", "worker_count": 1, "max_concurrency": 10240, "rate": 1.25}, [],
                  incomplete=2),
    ],
}


def test_rows_read_each_benchmark():
    rows = rows_of(REPORT, 2, 128)
    assert [r["benchmark"] for r in rows] == ["concurrent@1", "concurrent@8", "constant@1.25"]
    first, second, third = rows
    assert (first["requests_per_second"], first["output_tokens_per_second"]) == (2.5, 300.0)  # total, not successful
    assert (first["ttft_p50_ms"], first["ttft_p95_ms"]) == (30.0, 60.0)  # successful, not total
    assert (first["itl_p50_ms"], first["itl_p95_ms"]) == (3.2, 3.6)
    assert (first["latency_p50_s"], first["latency_p95_s"]) == (0.45, 0.5)
    assert first["short"] == 1  # the request the stop token ended after 1 token
    assert first["output_tokens_mean"] == pytest.approx(257 / 3)
    assert (second["completed"], second["incomplete"], second["errors"], second["streams"]) == (4, 8, 1, 8)
    assert second["short"] == 0 and second["warnings"] == ["generation_delay_ttft"]
    assert third["rate"] == 1.25 and third["completed"] == 0
    assert third["ttft_p50_ms"] is None and third["latency_p50_s"] is None  # nothing completed: no latency


def test_table_and_ratios():
    rows = rows_of(REPORT, 0, 128) + [dict(r, k=2, output_tokens_per_second=r["output_tokens_per_second"] * 1.5,
                                           latency_p50_s=r["latency_p50_s"] and r["latency_p50_s"] / 2)
                                      for r in rows_of(REPORT, 2, 128)]
    lines = format_table(rows).splitlines()
    assert len(lines) == 2 + 6 and all(line.count("|") == 12 for line in lines)
    k2_c8 = next(line for line in lines if line.startswith("| 2 | concurrent@8 "))
    assert k2_c8.endswith("| 1.50 | 0.50 |") and "| 4 / 8 / 1 |" in k2_c8
    constant = next(line for line in lines if line.startswith("| 0 | constant@1.25 "))
    assert "| - / - |" in constant and constant.endswith("| - |")


def test_rate_is_half_the_lowest_ks_best():
    rows = [{"k": 0, "requests_per_second": 2.0}, {"k": 0, "requests_per_second": 3.1},
            {"k": 2, "requests_per_second": 4.5}, {"k": 2, "requests_per_second": None}]
    assert constant_rate(rows) == 1.55
    with pytest.raises(SystemExit):
        constant_rate([{"k": 0, "requests_per_second": None}])


def test_request_keys_and_scenario(tmp_path):
    assert request_keys(REPORT) == ["ignore_eos", "max_tokens", "model", "prompt", "stream", "stream_options"]
    spec = scenario("http://127.0.0.1:1", ["a", "b", "c"], 64, {"kind": "concurrent", "streams": [1, 4]}, 20.0,
                    "/m", tmp_path / "r.json", 7)["spec"]
    data = spec["data"][0]["data"]
    assert data["prompt"] == ["a", "b", "c", "a", "b", "c", "a"] and data["output_tokens_count"] == [64] * 7
    assert spec["backend"]["request_format"] == "/v1/completions" and spec["backend"]["stream"] is True
    assert spec["constraints"] == [{"kind": "max_duration", "seconds": 20.0}]
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "r.json")}]
