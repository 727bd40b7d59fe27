"""Load an ortspec server with concurrent clients: throughput and latency at 1 / 8 / 32 clients.

    python3 tools/serve_load.py --model out/qwen35-python-20m -k 2 --clients 1,8,32   (starts `ortspec serve`)
    python3 tools/serve_load.py --url http://127.0.0.1:8000 --clients 1,8,32          (a running one)

With --model the server runs in a child process (`python3 -m ortspec serve` of this tree, on an
ephemeral port of 127.0.0.1), so the clients' threads do not share its interpreter.

Each client is a thread with its own HTTP connection per request (stdlib http.client, no extra
package), sending --requests requests one after another: prompts from the bench's code
prompts, max_tokens drawn from --max-tokens (a range MIN:MAX, or one number), streamed or not
(--stream both alternates). Reported per client count: generated tokens/s over the wall
time, requests/s, and the median and 95th percentile of request latency and of the time to
the first streamed token. The client functions are what the CI load test uses too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef list_files(path):",
           "def parse_args(argv=None):\n    parser = ", "for i in range(10):\n", "def quicksort(items):",
           "with open(path) as f:\n    for line in f:", "def main():\n    args = "]


@dataclasses.dataclass
class Completion:
    status: int
    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0  # request sent -> last byte
    first_token_seconds: float | None = None  # request sent -> first streamed token (streamed only)
    chunks: int = 0


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def complete(base_url: str, body: dict, timeout: float = 120.0, route: str = "/v1/completions") -> Completion:
    """One request; a streamed one (body["stream"]) is read event by event as it arrives."""
    connection, prefix = _connection(base_url, timeout)
    start = time.perf_counter()
    try:
        connection.request("POST", prefix + route, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if not body.get("stream") or response.status != 200:
            return _whole(response, start)
        return _streamed(response, start, chat=route.endswith("chat/completions"))
    finally:
        connection.close()


def _whole(response, start: float) -> Completion:
    body = response.read()
    if response.status != 200:  # an error body is ours (JSON), or a proxy's or server's own (any text)
        try:
            message = json.loads(body or b"{}").get("error", {}).get("message")
        except (ValueError, AttributeError):
            message = body.decode(errors="replace")[:200] or None
        return Completion(response.status, error=message, seconds=time.perf_counter() - start)
    doc = json.loads(body)
    choice = doc["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Completion(200, text, choice["token_ids"], choice["finish_reason"], seconds=time.perf_counter() - start)


def _streamed(response, start: float, chat: bool) -> Completion:
    result = Completion(200)
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            result.error = event["error"]["message"]
            break
        for choice in event["choices"]:
            if choice["token_ids"] and result.first_token_seconds is None:
                result.first_token_seconds = time.perf_counter() - start
            result.text += choice["delta"]["content"] if chat else choice["text"]
            result.token_ids += choice["token_ids"]
            result.finish_reason = choice["finish_reason"] or result.finish_reason
            result.chunks += 1
    result.seconds = time.perf_counter() - start
    return result


def get(base_url: str, path: str, timeout: float = 30.0) -> tuple[int, str]:
    connection, prefix = _connection(base_url, timeout)
    try:
        connection.request("GET", prefix + path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def run_clients(base_url: str, bodies: list[list[dict]], timeout: float = 120.0) -> tuple[list[list[Completion]], float]:
    """One thread per client, each sending its bodies in order; returns (results per client, wall seconds)."""
    results: list[list[Completion]] = [[] for _ in bodies]

    def client(i: int) -> None:
        for body in bodies[i]:
            results[i].append(complete(base_url, body, timeout))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def workload(clients: int, requests: int, max_tokens: tuple[int, int], stream: str, seed: int = 0) -> list[list[dict]]:
    """Request bodies per client: prompts in turn, max_tokens spread over the range, greedy. With
    stream "both" requests go in pairs, the same request streamed and not."""
    low, high = max_tokens
    bodies = []
    for c in range(clients):
        mine = []
        for r in range(requests):
            n = c * requests + r + seed
            streamed = {"yes": True, "no": False}.get(stream, n % 2 == 0)
            pair = n // 2 if stream == "both" else n
            mine.append({"prompt": PROMPTS[pair % len(PROMPTS)], "max_tokens": low + (pair * 7919) % (high - low + 1),
                         "stream": streamed})
        bodies.append(mine)
    return bodies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(clients: int, results: list[list[Completion]], seconds: float) -> dict:
    done = [r for rs in results for r in rs]
    ok = [r for r in done if r.status == 200 and r.error is None]
    tokens = sum(len(r.token_ids) for r in ok)
    first = [r.first_token_seconds for r in ok if r.first_token_seconds is not None]
    return {"clients": clients, "requests": len(done), "failed": len(done) - len(ok), "tokens": tokens,
            "seconds": seconds, "tokens_per_second": tokens / seconds, "requests_per_second": len(ok) / seconds,
            "latency_p50": percentile([r.seconds for r in ok], 0.5),
            "latency_p95": percentile([r.seconds for r in ok], 0.95),
            "first_token_p50": percentile(first, 0.5), "first_token_p95": percentile(first, 0.95)}


def format_table(rows: list[dict]) -> str:
    lines = ["clients  requests  failed  tokens   tok/s   req/s  latency p50/p95 s  first token p50/p95 s"]
    for r in rows:
        lines.append(f"{r['clients']:>7}  {r['requests']:>8}  {r['failed']:>6}  {r['tokens']:>6}  "
                     f"{r['tokens_per_second']:>6.1f}  {r['requests_per_second']:>6.2f}  "
                     f"{r['latency_p50']:>7.3f} / {r['latency_p95']:<7.3f}  "
                     f"{r['first_token_p50']:>7.3f} / {r['first_token_p95']:.3f}")
    return "\n".join(lines)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


class ServedURL(str):
    """The URL of a server `served` started; .pid: its process."""

    pid: int


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(CPU seconds of process pid, of its child processes, alive ones) from /proc (Linux; 0 elsewhere)."""
    def own(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def children(p: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{p}/task").glob("*/children") if Path(f"/proc/{p}/task").exists() else []:
            found += [int(c) for c in task.read_text().split()]
        return found + [g for c in found for g in children(c)]

    return own(pid), sum(own(c) for c in children(pid))


@contextlib.contextmanager
def served(model: Path, k: int, provider: str, threads: int | None, max_batch_size: int, engine: str = "process"):
    """`python3 -m ortspec serve` of this tree in a child process; yields its URL (a ServedURL),
    stops it with SIGINT."""
    command = [sys.executable, "-m", "ortspec", "serve", str(model), "--port", "0", "-k", str(k), "--provider", provider,
               "--max-batch-size", str(max_batch_size), "--max-queue", "1024", "--engine", engine]
    if threads:
        command += ["--threads", str(threads)]
    child = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in child.stderr:  # ONNX Runtime may warn before the server says where it listens
            found = re.search(r"(http://\S+?)/v1/completions", line)
            if found:
                break
            seen.append(line)
        else:
            raise SystemExit(f"serve_load: the server did not start: {''.join(seen[-20:])}")
        threading.Thread(target=child.stderr.read, daemon=True).start()  # drain: a full pipe would block the server
        url = ServedURL(found.group(1))
        url.pid = child.pid
        yield url
    finally:
        child.send_signal(signal.SIGINT)
        child.wait(timeout=60)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", type=Path, help="a converted model: start a server on 127.0.0.1 for the run")
    parser.add_argument("-k", type=int, default=0, help="with --model: MTP drafts per step")
    parser.add_argument("--provider", default="cpu", help="with --model: cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="with --model: intra-op threads")
    parser.add_argument("--max-batch-size", type=int, default=32, help="with --model: rows of the batch")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=_range, default=(32, 96), help="MIN:MAX tokens per request")
    parser.add_argument("--stream", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    server = (served(args.model, args.k, args.provider, args.threads, args.max_batch_size) if args.model
              else contextlib.nullcontext(args.url))
    with server as url:
        run_clients(url, workload(2, 1, (8, 8), "both"))  # warm-up: graph sessions, arenas
        rows = []
        for clients in (int(c) for c in args.clients.split(",")):
            results, seconds = run_clients(url, workload(clients, args.requests, args.max_tokens, args.stream))
            rows.append(summarize(clients, results, seconds))
            print(format_table(rows[-1:]).splitlines()[-1] if rows[:-1] else format_table(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"url": url, "model": str(args.model or ""), "k": args.k, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
