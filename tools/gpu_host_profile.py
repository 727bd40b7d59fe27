"""GPU host: where a step's host time goes (cProfile over running steps, CUDA graphs replayed).

    python tools/gpu_host_profile.py [MODEL_DIR] [--k 0,3] [--batch 1] [--steps 60]

For each k: a running batch (``Session.batcher``) is warmed up (graphs captured), then cProfile
records --steps steps. Prints the wall time per step and the functions with the most own time
per step (native calls and ONNX Runtime's run appear as built-ins), so the host overhead that
the kernel profile of tools/gpu_scale.py leaves unexplained is itemised.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnxruntime as ort  # noqa: E402

import ortspec  # noqa: E402

PROMPT = [11, 7, 3, 250, 99, 17, 5, 42]


def profile_steps(model: str, k: int, batch: int, steps: int, provider: str = "cuda", top: int = 22,
                  threads: int | None = None) -> None:
    session = ortspec.Session(model, provider=provider, num_speculative_tokens=k, threads=threads)
    batcher = session.batcher(max_batch_size=batch)
    for _ in range(batch):
        batcher.add_request(PROMPT, max_new_tokens=(k + 1) * (2 * steps + 10))
    for _ in range(5):
        batcher.step()
    start = time.perf_counter()
    for _ in range(steps):
        batcher.step()
    wall = (time.perf_counter() - start) / steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        batcher.step()
    profiler.disable()
    print(f"\n### k={k}, batch {batch}: {1e6 * wall:.0f} us per step unprofiled; own time per step "
          f"under cProfile (top {top})\n")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    print("| function | calls/step | own us/step | cumulative us/step |")
    print("|---|---|---|---|")
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(path).name}:{line}" if path != "~" else "built-in"
        print(f"| {name} ({where}) | {calls / steps:.1f} | {1e6 * own / steps:.0f} | {1e6 * cumulative / steps:.0f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="/tmp/trained_fp16")
    parser.add_argument("--k", default="0,3")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--provider", default="cuda", help="cuda, or cpu (then give --threads)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's)")
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    for k in (int(x) for x in args.k.split(",")):
        profile_steps(args.model, k, args.batch, args.steps, args.provider, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
