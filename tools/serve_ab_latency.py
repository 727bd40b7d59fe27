"""A/B: per-request latency of `ortspec serve` from two source trees, interleaved in one run.

    python3 tools/serve_ab_latency.py MODEL TREE_A TREE_B [--requests 300] [--rounds 6] [--sizes 1,128]
        [--stream yes] [--engine process] [--keepalive no]

Each tree's server runs at once (idle while the other is measured); each round runs, for each
size, a block of requests through A then B (B then A on odd rounds), one request at a time.
Reported per (tree, size): p50 / p90 latency (client side) and CPU ms per request of the
server's process and of its children (/proc), and B / A.
"""
import argparse, json, os, re, subprocess, sys, threading, time, http.client
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid):
    """(own, children's) CPU seconds of the process and its live children: every thread's schedstat (ns)."""
    def stat(p):
        total = 0
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                try:
                    total += int((task / "schedstat").read_text().split()[0])
                except OSError:
                    pass
        except OSError:
            pass
        return total / 1e9
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return stat(pid), sum(stat(int(k)) for k in kids)


def start(tree, model, k, engine, threads=None, provider="cpu", max_batch_size=8):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    cmd = [sys.executable, "-m", "ortspec", "serve", model, "--port", "0", "-k", str(k), "--max-batch-size",
           str(max_batch_size), "--max-queue", "1024", "--engine", engine, "--provider", provider] + \
        (["--threads", str(threads)] if threads else [])
    child = subprocess.Popen(cmd, cwd=tree, env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in child.stderr:
        seen.append(line)
        m = re.search(r"http://([\d.]+):(\d+)/v1/completions", line)
        if m:
            break
    else:
        raise SystemExit("".join(seen))
    threading.Thread(target=child.stderr.read, daemon=True).start()
    return child, (m.group(1), int(m.group(2))), line.strip()


class Client:
    def __init__(self, addr, keepalive):
        self.addr, self.keepalive, self.conn = addr, keepalive, None

    def request(self, body, stream):
        if self.conn is None:
            self.conn = http.client.HTTPConnection(*self.addr, timeout=60)
        t = time.perf_counter()
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        n = 0
        if stream:
            for line in r:
                if line.startswith(b"data: {"):
                    n += len(json.loads(line[6:])["choices"][0]["token_ids"])
        else:
            n = len(json.loads(r.read())["choices"][0]["token_ids"])
        dt = time.perf_counter() - t
        if r.status != 200:
            raise SystemExit(f"status {r.status}")
        if not self.keepalive:
            self.conn.close()
            self.conn = None
        return dt, n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model"), p.add_argument("trees", nargs="+")
    p.add_argument("--requests", type=int, default=300), p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--sizes", default="1,128"), p.add_argument("--stream", default="yes")
    p.add_argument("--engine", default="process"), p.add_argument("-k", default="0")
    p.add_argument("--keepalive", default="no"); p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    servers = [start(t, a.model, a.k, a.engine, a.threads) for t in a.trees]
    for t, (_, addr, line) in zip(a.trees, servers):
        print(t, "->", line)
    T = len(a.trees)
    lat = {(i, s): [] for i in range(T) for s in sizes}
    cpus = {(i, s): [0.0, 0.0, 0] for i in range(T) for s in sizes}
    try:
        for i in range(T):  # warm-up
            c = Client(servers[i][1], a.keepalive == "yes")
            for s in sizes:
                for j in range(20):
                    c.request(dict(prompt=f"# warm {j}\ndef f(x):\n    return", max_tokens=s, temperature=0,
                                   ignore_eos=True, stream=a.stream == "yes"), a.stream == "yes")
        per = a.requests // a.rounds
        for r in range(a.rounds):
            order = list(range(T)) if r % 2 == 0 else list(range(T))[::-1]
            for s in sizes:
                for i in order:
                    c = Client(servers[i][1], a.keepalive == "yes")
                    pid = servers[i][0].pid
                    c0 = cpu(pid)
                    for j in range(per):
                        dt, n = c.request(dict(prompt=f"# r{r} {j}\ndef f{j}(x):\n    return", max_tokens=s,
                                               temperature=0, ignore_eos=True, stream=a.stream == "yes"),
                                          a.stream == "yes")
                        assert n == s, (n, s)
                        lat[(i, s)].append(dt)
                    c1 = cpu(pid)
                    cc = cpus[(i, s)]
                    cc[0] += c1[0] - c0[0]; cc[1] += c1[1] - c0[1]; cc[2] += per
    finally:
        for child, _, _ in servers:
            child.send_signal(2)
            child.wait(60)
    q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))] * 1e3
    print("| size | tree | p50 ms | p90 ms | server CPU ms/req | engine CPU ms/req | p50 / first | p90 / first | CPU / first |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in sizes:
        for i in range(T):
            xs, cc = lat[(i, s)], cpus[(i, s)]
            x0, c0 = lat[(0, s)], cpus[(0, s)]
            print(f"| {s} | {i}:{Path(a.trees[i]).name} | {q(xs, .5):.3f} | {q(xs, .9):.3f} | {1e3 * cc[0] / cc[2]:.3f} | "
                  f"{1e3 * cc[1] / cc[2]:.3f} | {q(xs, .5) / q(x0, .5):.3f} | {q(xs, .9) / q(x0, .9):.3f} | "
                  f"{(cc[0] + cc[1]) / (c0[0] + c0[1]):.3f} |")


if __name__ == "__main__":
    main()
