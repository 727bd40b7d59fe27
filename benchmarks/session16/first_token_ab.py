"""A sampled request's first token chosen on the device (sample_logits) against the host's pick
(numpy transform of the downloaded logits), interleaved, one Session (session 16).

    python3 benchmarks/session16/first_token_ab.py MODEL_DIR [--provider cuda] [--prompt-tokens 32]
        [--rounds 20] [--threads N]

Per round and path: one request (temperature 0.8, top-p 0.95, seeded by the round) through a
batcher of one row, from add_request to its first token (max_new_tokens=1): the prefill and the
choice. Prints the medians, their ratio and whether both paths chose the same tokens.
"""
import argparse
import statistics
import time

import numpy as np

import ortspec
from ortspec.runtime.model import TargetModel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    options = dict(provider=a.provider) | (dict(threads=a.threads) if a.threads else {})
    session = ortspec.Session(a.model, **options)
    if "sample_logits" not in session.manifest.graphs:
        raise SystemExit(f"{a.model} has no sample_logits graph: convert it again")
    V = session.manifest.spec.vocab_size
    rng = np.random.default_rng(0)
    device_path = TargetModel.samples_last_rows
    times, tokens = {"device": [], "host": []}, {"device": [], "host": []}
    with session.batcher(max_batch_size=1) as batcher:
        for r in range(-2, a.rounds):  # two rounds of warm-up
            prompt = rng.integers(0, V, a.prompt_tokens).tolist()
            for path in (("device", "host") if r % 2 else ("host", "device")):
                TargetModel.samples_last_rows = device_path if path == "device" else (lambda self, out: False)
                start = time.perf_counter()
                rid = batcher.add_request(prompt, max_new_tokens=1, temperature=0.8, top_p=0.95, seed=r + 2)
                while batcher.pending:
                    batcher.step()
                seconds = time.perf_counter() - start
                if r >= 0:
                    times[path].append(seconds)
                    tokens[path].append(batcher.result(rid)[0])
                batcher.forget(rid)
    TargetModel.samples_last_rows = device_path
    d, h = (1e3 * statistics.median(times[k]) for k in ("device", "host"))
    print(f"{a.model} ({a.provider}, V = {V}), {a.prompt_tokens}-token prompts, {a.rounds} rounds, medians:")
    print("| first token chosen | ms from add_request to the first token |\n|---|---|")
    print(f"| on the host (numpy, from the downloaded logits) | {h:.2f} |\n| on the device (sample_logits) | {d:.2f} |")
    print(f"host / device {h / d:.2f}; same tokens: {tokens['device'] == tokens['host']}")


if __name__ == "__main__":
    main()
