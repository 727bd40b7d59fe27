"""``ortspec bench``: greedy and speculative tokens/s side by side, in one run.

Every configuration (k, batch) runs the same prompts; runs are interleaved round-robin over
``--repeats`` rounds so machine noise hits all configurations alike, and each reports the
median. Ratios are against greedy (k=0) at the same batch size.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tqdm.auto import tqdm

from .session import Session

PROMPT_TEXTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
                "for i in range(10):", "# Read the configuration file", "return sorted(items, key=lambda x:",
                "while True:\n    line = f.readline()", "with open(path) as f:"]


def _prompts(session: Session, batch: int) -> list[list[int]]:
    vocab = session.manifest.spec.vocab_size
    if session.manifest.tokenizer_path is not None:
        ids = [session.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    else:
        ids = [[(7 * i + 3 * j) % vocab for j in range(8 + i)] for i in range(len(PROMPT_TEXTS))]
    return [ids[i % len(ids)] for i in range(batch)]


def run_bench(model_dir, ks=(0, 1, 2, 3, 4), batches=(1,), max_new_tokens=64, repeats=3, provider="cpu",
              commit="select", threads=None, progress=True, pipeline_stages=1, devices=None) -> dict:
    sessions = {k: Session(model_dir, provider=provider, num_speculative_tokens=k, commit=commit, threads=threads,
                           pipeline_stages=pipeline_stages, devices=devices)
                for k in ks}
    samples = {(k, b): [] for k in ks for b in batches}
    stats = {}
    for k, b in samples:  # warm-up: first runs allocate and initialise
        sessions[k].generate(_prompts(sessions[k], b), max_new_tokens=8)
    bar = tqdm(total=repeats * len(samples), desc="ortspec bench", disable=not progress)
    for _ in range(repeats):
        for (k, b), times in samples.items():
            session = sessions[k]
            session.reset_stats()
            start = time.perf_counter()
            session.generate(_prompts(session, b), max_new_tokens=max_new_tokens)
            times.append(time.perf_counter() - start)
            stats[(k, b)] = session.stats
            bar.update()
    bar.close()
    rows = []
    for (k, b), times in samples.items():
        seconds = statistics.median(times)
        st = stats[(k, b)]
        rows.append({
            "k": k, "batch": b, "tokens_per_second": b * max_new_tokens / seconds, "seconds": seconds,
            "mean_tokens_per_step": st["mean_tokens_per_step"], "acceptance_rate": st["acceptance_rate"],
            "accept_histogram": st["accept_histogram"],
            "phase_ms": {p: 1000 * v for p, v in st["seconds"].items()},
            "steps": st["steps"],
            "graphs": st.get("graphs", {}),
        })
    greedy = {r["batch"]: r["tokens_per_second"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup_vs_greedy"] = r["tokens_per_second"] / greedy[r["batch"]] if r["batch"] in greedy else None
    return {"model": str(model_dir), "provider": provider, "commit": commit, "max_new_tokens": max_new_tokens,
            "repeats": repeats, "threads": threads, "pipeline_stages": pipeline_stages,
            "devices": sessions[ks[0]].devices, "rows": rows}


def transformers_greedy(checkpoint, batches=(1,), max_new_tokens=64, repeats=3, device="cpu", dtype="float32",
                        prompts_from=None) -> list[dict]:
    """transformers' own greedy generate on the same weights, for a side-by-side row (k = "hf").
    Prompts of a batch are left-padded to one length; tokens/s counts the new tokens."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(device).eval()
    rows = []
    for b in batches:
        prompts = _prompts(prompts_from, b)
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
    lines = ["| k | batch | tokens/s | vs greedy | tokens/step | acceptance | propose ms | verify ms | commit ms | decode ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("transformers", []):
        greedy = next((g for g in result["rows"] if g["k"] == 0 and g["batch"] == r["batch"]), None)
        ratio = f"{r['tokens_per_second'] / greedy['tokens_per_second']:.2f}x" if greedy else "-"
        lines.append(f"| transformers generate | {r['batch']} | {r['tokens_per_second']:.1f} | {ratio} | 1.00 | - | - | - | - | - |")
    for r in result["rows"]:
        ph = r["phase_ms"]
        ratio = f"{r['speedup_vs_greedy']:.2f}x" if r["speedup_vs_greedy"] else "-"
        lines.append(f"| {r['k']} | {r['batch']} | {r['tokens_per_second']:.1f} | {ratio} | "
                     f"{r['mean_tokens_per_step']:.2f} | {r['acceptance_rate']:.2f} | {ph['propose']:.1f} | "
                     f"{ph['verify']:.1f} | {ph['commit']:.1f} | {ph['decode']:.1f} |")
    return "\n".join(lines)


def write_outputs(result: dict, json_path: Path | None, plot_path: Path | None) -> None:
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    if plot_path:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("ortspec bench: matplotlib is not installed (pip install 'ortspec[bench]'); no plot written.")
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in sorted({r["batch"] for r in result["rows"]}):
            pts = sorted((r["k"], r["tokens_per_second"]) for r in result["rows"] if r["batch"] == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {b}")
        ax.set_xticks(sorted({r["k"] for r in result["rows"]}))
        ax.set_xlabel("k (drafts per step; 0 = greedy)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"ortspec bench ({result['provider']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)
