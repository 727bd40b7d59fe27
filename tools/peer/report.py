"""The harness's result: a JSON document (written after every phase, so a run cut short still
leaves what it measured) and the short markdown tables printed last.

Token comparisons count prompts (of the code and held-out sets together) whose tokens differ:
"vs ortspec greedy" against ortspec's greedy run (same precision), "vs peer eager" against the peer's own
eager greedy run; "-" where the reference did not run.
"""

from __future__ import annotations

import json
from pathlib import Path

from ortspec.errors import ConfigurationError

from .rounds import ConfigRun, differing_prompts

ORTSPEC_GREEDY, PEER_EAGER = "ortspec greedy", "peer eager"


def config_rows(runs: dict[str, ConfigRun], runners: dict, floor: dict | None = None,
                bandwidth: float | None = None) -> list[dict]:
    """One summary per configuration, with its tokens/step, both token comparisons and (CUDA)
    the share of its wall time per token that the bandwidth floor per token accounts for."""
    floor_ms = 1000 * floor["total"] / bandwidth if floor and bandwidth else None
    rows = []
    for name, run in runs.items():
        row = run.summary()
        row["floor_share"] = floor_ms / row["ms_per_token"] if floor_ms and row.get("ms_per_token") else None
        runner = runners.get(name)
        row["tokens_per_step"] = runner.count.per_step() if runner is not None else None
        row["differs_from_ortspec_greedy"] = differing_prompts(run, runs.get(ORTSPEC_GREEDY))
        row["differs_from_peer_eager"] = differing_prompts(run, runs.get(PEER_EAGER))
        row["prompts_compared"] = len(run.outputs)
        rows.append(row)
    return rows


def write_json(result: dict, path: Path | None) -> None:
    """Write through a temporary file and rename, so the JSON on disk is never half-written."""
    if path is None:
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """An earlier run's result (complete or cut short), for --report."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigurationError(f"--report {path}: cannot read it ({err}); give the file a run wrote with --json")
    if "checkpoint" not in result:
        raise ConfigurationError(f"--report {path}: not a peer_bench result (no 'checkpoint' key)")
    return result


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _pct(share) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def speed_table(rows: list[dict]) -> str:
    lines = ["| configuration | tok/s (median) | min-max | ms/token | tok per CPU-s | floor/wall | tokens/step |"
             " vs ortspec greedy | vs peer eager | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = (f"{r['tokens_per_second_min']:.0f}-{r['tokens_per_second_max']:.0f}"
                  if "tokens_per_second_min" in r else "-")
        same = [("-" if d is None else ("equal" if d == 0 else f"{d}/{r['prompts_compared']} differ"))
                for d in (r["differs_from_ortspec_greedy"], r["differs_from_peer_eager"])]
        changed = r["unstable_prompts"]
        note = r["error"] or (f"{changed} prompts changed between rounds" if changed else "")
        cells = [r["name"], _fmt(r.get("tokens_per_second"), ".0f"), spread, _fmt(r.get("ms_per_token"), ".3f"),
                 _fmt(r.get("tokens_per_cpu_second"), ".0f"), _pct(r.get("floor_share")),
                 _fmt(r["tokens_per_step"], ".2f"), *same, note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_table(profiles: dict[str, dict]) -> str:
    lines = ["| configuration | kernels/token | kernel us/token | GPU busy | kernel time / floor | floor / wall |",
             "|---|---|---|---|---|---|"]
    for name, p in profiles.items():
        if "error" in p:
            lines.append(f"| {name} | - | - | - | - | {p['error']} |")
            continue
        lines.append(f"| {name} | {p['kernels_per_token']:.0f} | {p['kernel_us_per_token']:.0f} | "
                     f"{_pct(p['gpu_busy_share'])} | {_fmt(p.get('kernel_over_floor'), '.2f')}x | "
                     f"{_pct(p.get('floor_share_of_wall'))} |")
    return "\n".join(lines)


def format_report(result: dict) -> str:
    """The tables printed last: speed and tokens, then the kernel profile where there is one."""
    head = (f"### {result['checkpoint']} ({result['provider']}, {result.get('precision', 'fp16')}, "
            f"{result.get('threads') or 'default'} threads, batch 1, {result['max_new_tokens']} new tokens, "
            f"{result['num_prompts']} prompts: code + held-out)")
    parts = [head, "", speed_table(result.get("configs", []))]
    if result.get("profiles"):
        floor = result.get("floor") or {}
        bandwidth = result.get("bandwidth_bytes_per_s")
        parts += ["", f"Kernel profile (CUPTI via torch.profiler), floor = {floor.get('total', 0) / 1e6:.1f} MB/token"
                  + (f" at {bandwidth / 1e12:.2f} TB/s measured copy rate" if bandwidth else ""), "",
                  profile_table(result["profiles"])]
    for note in result.get("notes", []):
        parts.append(f"- {note}")
    return "\n".join(parts)
