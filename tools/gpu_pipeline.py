"""GPU host check for pipeline stages on separate GPUs, then tokens/s, one stage against two.

    python tools/gpu_pipeline.py [--out DIR] [--json FILE]

Stages go on devices [0, 1] where the host has two GPUs, else on [0, 0] (the same code, no
peer copy). (1) two stages on those devices give the tokens of one stage, greedy and
speculative (k = 2 select, k = 3 readvance); (2) every state after every commit equals a
one-stage CUDA plain decode within 1e-5 (scripted drafts, batch 3, k = 3, both commits);
(3) no CUDA-graph fallback; (4) tokens/s of the medium fp16 model, one stage against two
stages on one GPU and (where present) two GPUs, batch 1/4/16, k = 0 and 2. Table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnxruntime as ort  # noqa: E402

import ortspec  # noqa: E402
from ortspec import _native  # noqa: E402
from ortspec.bench import run_bench  # noqa: E402
from ortspec.runtime.graphs import GraphSet  # noqa: E402
from ortspec.speculative.exactness import ExactnessError, check_speculative, plain_decode_states  # noqa: E402
from tools.gpu_check import MEDIUM  # noqa: E402
from tools.make_tiny_checkpoint import make_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/ortspec_gpu_pipeline")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    gpus = _native.build_info()["cuda_device_count"]
    devices = [0, 1] if gpus >= 2 else [0, 0]
    print(f"{gpus} GPU(s); two stages on devices {devices}")
    out, failures, results = Path(args.out), 0, {"gpus": gpus, "devices": devices}
    tiny = out / "tiny"
    ortspec.convert(ROOT / "models" / "tiny-qwen35", tiny, num_speculative_tokens=4, max_length=256,
                    pipeline_stages=2, overwrite=True, progress=False)

    one = ortspec.Session(tiny, provider="cuda").generate(PROMPTS, max_new_tokens=48)
    for k, commit in ((0, "select"), (2, "select"), (3, "readvance")):
        session = ortspec.Session(tiny, provider="cuda", pipeline_stages=2, devices=devices,
                                  num_speculative_tokens=k, commit=commit)
        ok = [session.generate(PROMPTS, max_new_tokens=48) for _ in range(2)] == [one, one]
        bad_graphs = sum(c["fallbacks"] + c["invalidations"] for c in session.stats["graphs"].values())
        failures += (not ok) + (bad_graphs != 0)
        results[f"tokens_k{k}_{commit}"] = ok
        print(f"two stages on {devices}, k={k} {commit}, twice: equal to one stage: {ok}; "
              f"graph fallbacks+invalidations: {bad_graphs}")

    single = GraphSet(ortspec.Session(tiny, provider="cuda").manifest, provider="cuda")
    staged = GraphSet(single.manifest, provider="cuda", devices=devices)
    reference = plain_decode_states(single, PROMPTS, 40 + 3 + 1, 3)
    steps = 0
    for commit in ("select", "readvance"):
        try:
            steps += check_speculative(staged, PROMPTS, 40, 3, commit, p=0.6, reference=reference, atol=1e-5,
                                       stages=2).speculative_steps
        except ExactnessError as error:
            failures += 1
            print("STATE CHECK FAILED:", error)
    results["state_check_steps"] = steps
    print(f"states after every commit, two stages on {devices} vs one-stage plain decode: {steps} steps within 1e-5")
    print("weight bytes per device:", staged.weight_bytes)

    medium = out / "medium"
    make_checkpoint(medium / "ck", seed=7, draft_agreement=10.0, **MEDIUM)
    ortspec.convert(medium / "ck", medium / "fp16", num_speculative_tokens=4, max_length=512, dtype="float16",
                    pipeline_stages=2, overwrite=True, progress=False)
    layouts = [("1 stage", 1, None), ("2 stages, 1 GPU", 2, [0, 0])] + ([("2 stages, 2 GPUs", 2, [0, 1])]
                                                                         if gpus >= 2 else [])
    benches = {}
    for label, stages, devs in layouts:
        benches[label] = run_bench(medium / "fp16", ks=(0, 2), batches=(1, 4, 16), max_new_tokens=64, repeats=3,
                                   provider="cuda", pipeline_stages=stages, devices=devs, progress=False)
    results["bench"] = benches
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n### medium (116M params, random), fp16, tokens/s by pipeline layout\n")
    print("| k | batch | " + " | ".join(benches) + " |")
    print("|---|---|" + "---|" * len(benches))
    base = benches["1 stage"]["rows"]
    for i, row in enumerate(base):
        cells = [f"{b['rows'][i]['tokens_per_second']:.0f} ({b['rows'][i]['tokens_per_second'] / row['tokens_per_second']:.2f})"
                 for b in benches.values()]
        print(f"| {row['k']} | {row['batch']} | " + " | ".join(cells) + " |")
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
