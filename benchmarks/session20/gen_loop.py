"""generate() of one held-out prompt after another, batch B, for SECONDS: the load py-spy samples on
the generate side (visit.sh p), beside the server's engine process.
    python3 gen_loop.py MODEL K B SECONDS [cuda|cpu]"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import ortspec  # noqa: E402

model, k, batch, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
provider = sys.argv[5] if len(sys.argv) > 5 else "cuda"
session = ortspec.Session(model, provider=provider, num_speculative_tokens=k if k == "auto" else int(k))
texts = json.loads((Path(__file__).resolve().parents[1] / "heldout_prompts.json").read_text())
texts = texts["prompts"] if isinstance(texts, dict) else texts
prompts = [session.tokenizer.encode(f"# {i}\n{texts[i % len(texts)]}").ids for i in range(64)]
session.generate(prompts[:batch], max_new_tokens=8)
start, tokens, i = time.perf_counter(), 0, 0
while time.perf_counter() - start < seconds:
    out = session.generate([prompts[(i + j) % 64] for j in range(batch)], max_new_tokens=128)
    tokens, i = tokens + sum(map(len, out)), i + batch
print(f"generate k={k} batch {batch}: {tokens / (time.perf_counter() - start):.0f} tok/s", flush=True)
