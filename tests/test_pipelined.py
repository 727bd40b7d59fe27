"""The loop at depth 1 (the host a step ahead of the GPU) over greedy decode steps is the loop at
depth 0, bit for bit: same tokens, same states, the same steps counted; a stop token costs one
dropped step, a budget none. Depth 1 is the CUDA default; here it is forced onto the CPU
(pipelined=True, fixed rows), where every forward is bitwise reproducible, so any difference is
the loop's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import ortspec
from ortspec.runtime.decode_run import DecodeRun
from ortspec.runtime.fused_run import FusedRun
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.streams import HostReadback
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.requests import Request
from ortspec.speculative.stats import Stats

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def graphs(models):
    return GraphSet(ortspec.Session(models.converted("base")).manifest)


def decode(graphs, specs, pipelined: bool) -> tuple[list[list[int]], Decoder]:
    """Greedy over (prompt, max_new_tokens, stop tokens) in rows 0.., every row running every step."""
    requests = [Request(row=i, prompt=list(p), max_new_tokens=n, stop_tokens=frozenset(stops))
                for i, (p, n, stops) in enumerate(specs)]
    decoder = Decoder(graphs, len(requests), 0, "select", Stats(), fixed_rows=True, pipelined=pipelined)
    assert decoder.depth == pipelined
    return decoder.generate(requests), decoder


def count_steps(monkeypatch) -> list[int]:
    """Counts the forwards the loop enqueues (DecodeRun.enqueue calls)."""
    calls = [0]
    original = DecodeRun.enqueue

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecodeRun, "enqueue", counted)
    return calls


@pytest.mark.parametrize("config", ["base", "mixed"])
def test_tokens_and_states_equal_the_plain_loop(models, config):
    graphs = GraphSet(ortspec.Session(models.converted(config)).manifest)
    specs = [(p, 30, ()) for p in PROMPTS]
    plain, plain_decoder = decode(graphs, specs, pipelined=False)
    piped, piped_decoder = decode(graphs, specs, pipelined=True)
    assert piped == plain
    assert piped_decoder.stats.decode_steps == plain_decoder.stats.decode_steps == 29
    assert piped_decoder.stats.pipelined_steps == 29 and plain_decoder.stats.pipelined_steps == 0
    for row, prompt in enumerate(PROMPTS):  # every row ran 29 steps in both: states bitwise equal
        length = len(prompt) + 29
        a = plain_decoder.target.states.row_state(row, length)
        b = piped_decoder.target.states.row_state(row, length)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"row {row} {name}")


def test_budgets_cost_no_extra_step_and_finished_rows_keep_running(graphs, monkeypatch):
    specs = [(PROMPTS[0], 12, ()), (PROMPTS[1], 1, ()), (PROMPTS[2], 25, ())]  # row 1 is done at its prefill
    plain, plain_decoder = decode(graphs, specs, pipelined=False)
    calls = count_steps(monkeypatch)
    piped, piped_decoder = decode(graphs, specs, pipelined=True)
    assert piped == plain and [len(t) for t in piped] == [12, 1, 25]
    assert calls[0] == plain_decoder.stats.decode_steps == 24  # the longest budget's steps, not one more
    assert piped_decoder.stats.generated_tokens == plain_decoder.stats.generated_tokens


def test_a_stop_token_costs_one_dropped_step(graphs, monkeypatch):
    free, _ = decode(graphs, [(PROMPTS[0], 30, ())], pipelined=False)
    stop = free[0][9]  # request 0 stops at its first occurrence of this token
    for specs, extra in (([(PROMPTS[0], 30, (stop,)), (PROMPTS[1], 4, ()), (PROMPTS[2], 6, ())], 1),  # it ends last
                         ([(PROMPTS[0], 30, (stop,)), (PROMPTS[1], 20, ())], 0)):  # another runs on past it
        plain, plain_decoder = decode(graphs, specs, pipelined=False)
        assert plain[0][-1] == stop and len(plain[0]) <= 10
        calls = count_steps(monkeypatch)
        piped, piped_decoder = decode(graphs, specs, pipelined=True)
        assert piped == plain
        assert calls[0] == plain_decoder.stats.decode_steps + extra
        assert piped_decoder.stats.decode_steps == plain_decoder.stats.decode_steps  # a dropped step is not counted


def test_a_request_may_fill_max_length(models):
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    long = list(np.arange(200) % 300 + 1)
    specs = [(long, graphs.manifest.max_length - len(long), ()), (PROMPTS[1], 20, ())]
    plain, _ = decode(graphs, specs, pipelined=False)
    piped, _ = decode(graphs, specs, pipelined=True)
    assert piped == plain and len(piped[0]) == graphs.manifest.max_length - len(long)


def stand_in_static_inputs(monkeypatch, graphs, graph: str) -> dict:
    """On the CPU, a slot table for ``graph``'s runs: each run with a slot key loads its host
    input_ids and positions into static buffers of that key (as CapturedSlot.load_inputs does), which
    ``slots.static_input`` hands out. Returns the table {key: {name: buffer}}."""
    statics: dict = {}
    runner = graphs[graph]
    run = runner.run

    def run_with_static_inputs(feeds, slot=None, wait=True):
        if slot is not None:
            table = statics.setdefault(slot, {n: np.zeros_like(feeds[n]) for n in ("input_ids", "positions")})
            for name, static in table.items():
                if feeds[name] is not static:
                    static[...] = feeds[name]
        return run(feeds, slot, wait)

    monkeypatch.setattr(runner, "run", run_with_static_inputs)
    monkeypatch.setattr(graphs.slots, "static_input", lambda key, name: statics.get(key, {}).get(name))
    monkeypatch.setattr(DecodeRun, "host_binding", False)  # the CUDA path, not the CPU's IOBinding
    monkeypatch.setattr(FusedRun, "host_binding", False)
    return statics


def test_the_captured_slot_path_equals_the_plain_loop(models, monkeypatch):
    """DecodeRun's CUDA path (next inputs written into a captured slot's static buffers, the
    positions advanced where they live, the KV commit reading them) run on the CPU over a
    stand-in slot table that loads each run's host inputs into the static buffers, as
    CapturedSlot.load_inputs does; with a request parked at max_length."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    long = list(np.arange(200) % 300 + 1)
    specs = [(long, graphs.manifest.max_length - len(long), ()), (PROMPTS[1], 70, ()), (PROMPTS[2], 9, ())]
    plain, _ = decode(graphs, specs, pipelined=False)
    statics = stand_in_static_inputs(monkeypatch, graphs, "decode")
    piped, _ = decode(graphs, specs, pipelined=True)
    assert statics and piped == plain


def test_streamed_and_session_outputs_equal_the_plain_loop(models):
    session = ortspec.Session(models.converted("base"))
    plain = session.generate(PROMPTS, max_new_tokens=16, stop_tokens=[])
    assert session.generate(PROMPTS, max_new_tokens=16, stop_tokens=[], fixed_rows=True, pipelined=True) == plain
    streamed = session.generate(PROMPTS[2], max_new_tokens=16, stop_tokens=[], stream=True, fixed_rows=True,
                                pipelined=True)
    assert list(streamed) == plain[2]
    assert session.stats["pipelined_steps"] == 2 * 15


def test_a_step_late_feed_is_caught(graphs, monkeypatch):
    """The comparison is not vacuous: feed each step the tokens of the step before (a pipelining
    bug that reads the wrong slot) and the tokens must differ."""
    plain, _ = decode(graphs, [(p, 20, ()) for p in PROMPTS], pipelined=False)
    history = []

    def stale_feed(self, out, positions):
        history.append(np.array(out["tokens"]))
        return (history[-2] if len(history) > 1 else history[-1]), positions

    monkeypatch.setattr(DecodeRun, "_feed", stale_feed)
    piped, _ = decode(graphs, [(p, 20, ()) for p in PROMPTS], pipelined=True)
    assert piped != plain


def test_where_no_step_runs_ahead(models, graphs):
    session = ortspec.Session(models.converted("base"))
    session.generate(PROMPTS, max_new_tokens=8)  # the CPU default: depth 0
    session.generate(PROMPTS, max_new_tokens=8, fixed_rows=True, pipelined=False)
    assert session.stats["pipelined_steps"] == 0
    sampled = dict(max_new_tokens=8, temperature=0.8, seed=3, fixed_rows=True)  # drawn on the device: ahead too
    assert session.generate(PROMPTS, **sampled, pipelined=True) == session.generate(PROMPTS, **sampled)
    assert session.stats["pipelined_steps"] > 0
    session.reset_stats()
    with_logprobs = session.batcher(max_batch_size=3, fixed_rows=True, pipelined=True)  # the logits to the host
    with_logprobs.add_request(PROMPTS[0], max_new_tokens=8, logprobs=1)
    while with_logprobs.pending:
        with_logprobs.step()
    with_logprobs.close()
    assert session.stats["pipelined_steps"] == 0
    session.generate(PROMPTS, max_new_tokens=8, pipelined=True)  # rows not fixed: the running rows run ahead
    assert session.stats["pipelined_steps"] > 0


@pytest.mark.parametrize("shared_stream,stages,pipelined,expected", [
    (True, 1, None, 1), (False, 1, None, 0), (True, 2, None, 0), (True, 1, False, 0)])
def test_on_cuda_depth_1_needs_the_stream_shared_with_onnx_runtime(monkeypatch, graphs, shared_stream, stages,
                                                                   pipelined, expected):
    """Depth 1 on CUDA: the default where the stream is shared with ONNX Runtime and one pipeline
    stage runs; a stand-in CUDA arrays object (nothing runs: the decoder is only built)."""
    arrays = SimpleNamespace(device="cuda", shared_stream=shared_stream)
    monkeypatch.setattr(graphs, "arrays", arrays)
    engine = SimpleNamespace(target=SimpleNamespace(graphs=graphs), mtp=None)
    decoder = Decoder(graphs, 3, 0, "select", Stats(), engine=engine, stages=stages, pipelined=pipelined)
    assert decoder.depth == expected


def test_host_readback_returns_what_was_started():
    readback = HostReadback()
    source = np.arange(4).reshape(2, 2)
    readback.start(source)
    source[0, 0] = 99  # the copy was taken at start()
    assert readback.wait().tolist() == [[0, 1], [2, 3]]
