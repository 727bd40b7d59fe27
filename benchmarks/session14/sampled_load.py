"""C streaming clients sending sampled requests (temperature 0.8, top-p 0.95, each seeded) until killed:
the load engine_profile.sh puts on a server with TEMPERATURE set.
    python3 sampled_load.py URL CLIENTS [TEMPERATURE]"""
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.serve_load import PROMPTS, complete  # noqa: E402

url, clients = sys.argv[1], int(sys.argv[2])
temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.8


def client(c: int) -> None:
    for r in range(10**9):
        complete(url, {"prompt": f"# {c} {r}\n{PROMPTS[(c + r) % len(PROMPTS)]}", "max_tokens": 128, "stream": True,
                       "temperature": temperature, "top_p": 0.95, "seed": c * 100000 + r})


for c in range(clients):
    threading.Thread(target=client, args=(c,), daemon=True).start()
threading.Event().wait()
