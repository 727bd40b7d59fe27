"""The loopback load test: 32 concurrent clients x 4 requests of mixed lengths, half streamed,
against a server on 127.0.0.1 (an ephemeral port) with k = 2 over 8 rows (so requests queue).

Every output equals Session.generate for its prompt (greedy), streamed text equals the
non-streamed text of the same request, the memory of the process stays flat, and the server
shuts down cleanly. Flat: the resident memory after the load exceeds the memory after a
warm-up round (same clients, one request each) by less than MAX_GROWTH; the load makes 4x the
warm-up's requests, so a leak of a few hundred KiB per request (a kept job, detokenizer,
event queue or request object) would cross it.
"""

from __future__ import annotations

import functools
import gc
import json
import resource
import threading

import pytest

import ortspec
from ortspec.serve.server import Server
from tools.make_tiny_checkpoint import make_checkpoint
from tools.serve_load import get, run_clients, workload

CLIENTS, REQUESTS = 32, 4
MAX_TOKENS = (4, 64)
MAX_GROWTH = 24 << 20  # bytes of resident memory the load may add after the warm-up


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    make_checkpoint(root / "ck", seed=31, tokenizer=True)
    return ortspec.convert(root / "ck", root / "out", num_speculative_tokens=2, max_length=96, progress=False)


@pytest.mark.parametrize("apart", [False, True], ids=["", "prefills-apart"])
def test_32_streaming_clients(model, apart):
    """apart: the CUDA server's loop on the CPU (depth 1, fixed rows, prefills on their own thread)."""
    bodies = workload(CLIENTS, REQUESTS, MAX_TOKENS, "both")
    threads_before = set(threading.enumerate())
    with ortspec.Session(model, num_speculative_tokens=2) as session:
        if apart:
            session.batcher = functools.partial(session.batcher, background_prefill=True, pipelined=True,
                                                fixed_rows=True)
        want = {(b["prompt"], b["max_tokens"]): session.generate(b["prompt"], max_new_tokens=b["max_tokens"])
                for client in bodies for b in client}
        server = Server(session, port=0, max_batch_size=8, max_queue=CLIENTS).start()
        try:
            run_clients(server.url, workload(CLIENTS, 1, MAX_TOKENS, "both", seed=1))  # warm-up
            gc.collect()
            warm = resident_bytes()
            results, _ = run_clients(server.url, bodies)
            gc.collect()
            grown = resident_bytes() - warm
            metrics = get(server.url, "/metrics")[1]
        finally:
            server.stop()
    replies = [(body, reply) for client, mine in zip(bodies, results) for body, reply in zip(client, mine)]
    assert len(replies) == CLIENTS * REQUESTS
    for body, reply in replies:
        assert reply.status == 200 and reply.error is None, reply.error
        assert reply.text == want[(body["prompt"], body["max_tokens"])], body
    streamed = {(b["prompt"], b["max_tokens"]): r.text for b, r in replies if b["stream"]}
    whole = {(b["prompt"], b["max_tokens"]): r.text for b, r in replies if not b["stream"]}
    assert {key: streamed[key] for key in streamed.keys() & whole.keys()} == \
           {key: whole[key] for key in streamed.keys() & whole.keys()}
    assert len(streamed.keys() & whole.keys()) >= CLIENTS
    assert grown < MAX_GROWTH, f"resident memory grew by {grown / 2**20:.1f} MiB over the load"
    assert "ortspec_running_requests 0" in metrics and "ortspec_queue_depth 0" in metrics
    assert set(threading.enumerate()) <= threads_before  # engine and HTTP threads gone: a clean shutdown
    print(json.dumps({"resident_growth_mib": round(grown / 2**20, 2)}))
