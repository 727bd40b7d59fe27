"""A/B throughput: servers of N trees up at once; per round and tree (order alternating) C clients
each send R streamed requests of --max-tokens one after another; tok/s and CPU ms per 1000 tokens.
    python3 tools/serve_ab_throughput.py MODEL TREE... [--clients 1,8] [--requests 2] [--rounds 10] [--engine process]
        [--provider cuda] [--temperature T]  (the server's max batch size: the most clients; T > 0: sampled
        requests, top-p 0.95, each seeded). A TREE written TREE@MODEL serves its own model directory (one its
        converter made) instead of MODEL."""
import argparse, statistics, sys, threading, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_ab_latency import Client, cpu, start  # noqa: E402



def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model"); p.add_argument("trees", nargs="+")
    p.add_argument("--clients", default="1,8"); p.add_argument("--requests", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10); p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine", default="process"); p.add_argument("-k", default="0"); p.add_argument("--threads", type=int, default=None)
    p.add_argument("--provider", default="cpu"); p.add_argument("--temperature", type=float, default=0.0)
    a = p.parse_args()
    T, cs = len(a.trees), [int(c) for c in a.clients.split(",")]
    servers = [start(t.partition("@")[0], t.partition("@")[2] or a.model, a.k, a.engine, a.threads, a.provider, max(cs))
               for t in a.trees]
    res = {(i, c): [] for i in range(T) for c in cs}
    cpu_per = {(i, c): [0.0, 0, 0.0] for i in range(T) for c in cs}


    def load(addr, c, tag):
        counts = [0] * c
        def client(j):
            cl = Client(addr, False)
            for r in range(a.requests):
                body = dict(prompt=f"# {tag} {j} {r}\ndef g{j}(x):\n    return", max_tokens=a.max_tokens, temperature=0,
                            ignore_eos=True, stream=True)
                if a.temperature > 0:
                    body.update(temperature=a.temperature, top_p=0.95, seed=1000 * j + r)
                _, n = cl.request(body, True)
                counts[j] += n
        th = [threading.Thread(target=client, args=(j,)) for j in range(c)]
        t = time.perf_counter()
        for x in th: x.start()
        for x in th: x.join()
        return sum(counts), time.perf_counter() - t


    try:
        for i in range(T):
            for c in cs:
                load(servers[i][1], c, "warm")
        for r in range(a.rounds):
            order = list(range(T)) if r % 2 == 0 else list(range(T))[::-1]
            for c in cs:
                for i in order:
                    pid = servers[i][0].pid
                    c0 = cpu(pid)
                    n, dt = load(servers[i][1], c, f"r{r}")
                    c1 = cpu(pid)
                    res[(i, c)].append(n / dt)
                    cpu_per[(i, c)][0] += (c1[0] - c0[0]) + (c1[1] - c0[1]); cpu_per[(i, c)][1] += n; cpu_per[(i, c)][2] += c1[0] - c0[0]
    finally:
        for child, _, _ in servers:
            child.send_signal(2); child.wait(60)
    print("| clients | tree | tok/s (median of rounds) | / first | CPU ms per 1000 tokens, both processes | / first | HTTP process's | / first |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cs:
        b, bc, bh = statistics.median(res[(0, c)]), cpu_per[(0, c)][0] / cpu_per[(0, c)][1], cpu_per[(0, c)][2] / cpu_per[(0, c)][1]
        for i in range(T):
            m, mc, mh = statistics.median(res[(i, c)]), cpu_per[(i, c)][0] / cpu_per[(i, c)][1], cpu_per[(i, c)][2] / cpu_per[(i, c)][1]
            print(f"| {c} | {i}:{Path(a.trees[i].partition('@')[0]).name} | {m:.0f} | {m / b:.3f} | {1e6 * mc:.1f} | {mc / bc:.3f} | {1e6 * mh:.1f} | {mh / bh:.3f} |")


if __name__ == "__main__":
    main()
