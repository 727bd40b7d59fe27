"""The PNG of ``ortspec bench --plot``: tokens/s against k, one line per (dtype, batch).

The y axis starts at 0 (a ratio read off a truncated axis looks larger than it is); each point
is the median over the repeats with an error bar from the slowest to the fastest repeat; the
title names the model, provider, threads, new tokens and repeats, so a saved plot says what it
measured. The data and the title are pure functions of the bench result (testable without
matplotlib); ``draw`` and ``write_plot`` need matplotlib.
"""

from __future__ import annotations

from pathlib import Path

from .errors import MissingDependencyError

INSTALL_HINT = "pip install 'ortspec[bench]' (or pip install matplotlib)"


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend; MissingDependencyError saying what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise MissingDependencyError(f"--plot needs matplotlib, which is not installed ({error}); "
                                     f"{INSTALL_HINT}, or drop --plot.") from error
    return plt


def series(result: dict) -> list[dict]:
    """One line per (dtype, batch): label, k values, median tokens/s, and the distance down to
    the slowest and up to the fastest repeat (error bars; 0 when a row has no repeat times).
    Rows of k = "auto" have no place on the k axis: the table shows them."""
    rows = [r for r in result["rows"] if isinstance(r["k"], int)]
    dtypes = sorted({r.get("dtype") for r in rows}, key=str)
    lines = []
    for dtype in dtypes:
        for batch in sorted({r["batch"] for r in rows}):
            points = sorted((r for r in rows if r["batch"] == batch and r.get("dtype") == dtype), key=lambda r: r["k"])
            if not points:
                continue
            label = f"{dtype}, batch {batch}" if len(dtypes) > 1 else f"batch {batch}"
            median = [r["tokens_per_second"] for r in points]
            tokens = [batch * result["max_new_tokens"] for _ in points]
            spread = [_repeat_range(r, n) or (m, m) for r, n, m in zip(points, tokens, median)]  # (slowest, fastest)
            lines.append({"label": label, "k": [r["k"] for r in points], "tokens_per_second": median,
                          "below": [m - low for m, (low, _) in zip(median, spread)],
                          "above": [high - m for m, (_, high) in zip(median, spread)]})
    return lines


def _repeat_range(row: dict, tokens: int) -> tuple[float, float] | None:
    """(slowest, fastest) tokens/s over the repeats of one row that generated `tokens` per repeat."""
    seconds = row.get("repeat_seconds")
    if not seconds:
        return None
    return tokens / max(seconds), tokens / min(seconds)


def title(result: dict) -> str:
    """'ortspec bench: MODEL (dtypes), cuda, 4 threads, 64 new tokens, median of 3'."""
    model = Path(result["model"]).name or result["model"]
    dtypes = result.get("dtypes") or sorted({str(r.get("dtype")) for r in result["rows"]})
    threads = result.get("threads")
    threads = f"{threads} thread{'s' if threads != 1 else ''}" if threads else "default threads"
    return (f"ortspec bench: {model} ({', '.join(dtypes)}), {result['provider']}, {threads}, "
            f"{result['max_new_tokens']} new tokens, median of {result['repeats']}")


def draw(result: dict):
    """The matplotlib figure of a bench result."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for line in series(result):
        ax.errorbar(line["k"], line["tokens_per_second"], yerr=[line["below"], line["above"]], marker="o",
                    capsize=3, label=line["label"])
    ax.set_xticks(sorted({r["k"] for r in result["rows"] if isinstance(r["k"], int)}))
    ax.set_xlabel("k (drafts per step; 0 = greedy)")
    ax.set_ylabel("tokens/s (median; bars: slowest to fastest repeat)")
    ax.set_ylim(bottom=0)
    ax.set_title(title(result), fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig


def write_plot(result: dict, path: Path) -> None:
    """Draws the plot and writes it to ``path`` (through a temporary file: never half-written)."""
    plt = require_matplotlib()
    fig = draw(result)
    partial = path.with_name(path.name + ".partial.png")
    try:
        fig.savefig(partial, dpi=120)
        partial.replace(path)
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
