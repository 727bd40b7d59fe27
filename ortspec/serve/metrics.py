"""/metrics in Prometheus' text format (version 0.0.4), written out by hand: a few gauges and
counters do not need a client library."""

from __future__ import annotations

import time

from .engine import Engine


def _metric(lines: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP ortspec_{name} {help_text}", f"# TYPE ortspec_{name} {kind}"]
    lines += [f"ortspec_{name}{labels} {value:.6g}" if isinstance(value, float) else f"ortspec_{name}{labels} {value}"
              for labels, value in samples]


def prometheus_text(engine: Engine, stats: dict, refused: dict | None = None) -> str:
    """The engine's live gauges and counters, the Session's decoding totals (stats), and the
    requests the HTTP side refused while checking them (refused: status -> count)."""
    metrics, lines = engine.metrics, []
    _metric(lines, "queue_depth", "gauge", "Requests waiting for a free row.", [("", engine.queue_depth)])
    _metric(lines, "queue_capacity", "gauge", "Requests the queue holds before answering 429.",
            [("", engine.max_queue)])
    _metric(lines, "running_requests", "gauge", "Requests holding a row of the batch.", [("", engine.running)])
    _metric(lines, "max_batch_size", "gauge", "Rows of the continuous batch.", [("", engine.max_batch_size)])
    _metric(lines, "tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
            [("", metrics.tokens_per_second(time.monotonic()))])
    _metric(lines, "generated_tokens_total", "counter", "Tokens sent to clients.", [("", metrics.generated)])
    _metric(lines, "prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", metrics.prompt_tokens)])
    _metric(lines, "requests_admitted_total", "counter", "Requests that got a row.", [("", metrics.admitted)])
    _metric(lines, "requests_finished_total", "counter",
            "Requests (choices) ended, by finish reason or HTTP status (429, 503: also refused at submit).",
            [(f'{{reason="{reason}"}}', count) for reason, count in sorted(metrics.finished.items(), key=str)])
    _metric(lines, "requests_refused_total", "counter",
            "Requests refused while checked, before any was queued, by HTTP status (400, 408, 413, 422).",
            [(f'{{status="{status}"}}', count) for status, count in sorted((refused or {}).items())])
    _metric(lines, "acceptance_rate", "gauge", "Drafts accepted / drafts proposed, since start.",
            [("", float(stats["acceptance_rate"]))])
    _metric(lines, "mean_tokens_per_step", "gauge", "Tokens a request gains per speculative step, since start.",
            [("", float(stats["mean_tokens_per_step"]))])
    _metric(lines, "steps_total", "counter", "Target forwards over new tokens (decode and speculative steps).",
            [("", stats["steps"])])
    _metric(lines, "engine_seconds_total", "counter", "Seconds the decoder spent in each phase of its steps (the "
            "rest of the wall time: the engine's own turns, and waiting for requests).",
            [(f'{{phase="{phase}"}}', float(seconds)) for phase, seconds in sorted(stats.get("seconds", {}).items())])
    return "\n".join(lines) + "\n"
