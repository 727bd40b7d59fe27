"""The CPU runtime passes the graphs a window of each KV cache (the first W slots past the
positions of the call) instead of all max_length slots: same bits, less work."""

from __future__ import annotations

import numpy as np

import ortspec
from ortspec.manifest import Manifest
from ortspec.runtime.graphs import GraphRunner, GraphSet
from ortspec.runtime.host_binding import HostBinding
from ortspec.runtime.kv_window import window_slots
from ortspec.runtime.model import TargetModel
from ortspec.runtime.states import Rows

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def read_inputs(feeds: dict, slot) -> dict:
    """Every input a Run reads: a bound forward is fed its step inputs only, and reads the states
    where its binding holds them (``HostBinding.inputs``)."""
    return {**slot.inputs, **feeds} if isinstance(slot, HostBinding) else feeds


def test_window_covers_the_last_position_plus_reach():
    assert window_slots(1024, 0, 1) == 64 and window_slots(1024, 62, 1) == 64 and window_slots(1024, 63, 1) == 64
    assert window_slots(1024, 64, 1) == 128 and window_slots(1024, 60, 4) == 64 and window_slots(1024, 61, 4) == 128
    assert window_slots(100, 99, 1) == 100 and window_slots(100, 90, 4) == 100  # never past max_length


def test_windowed_and_full_caches_give_the_same_tokens(models, monkeypatch):
    """Speculative k=3 with windows (recorded: every KV feed narrower than max_length whenever the
    positions allow) equals greedy over all max_length slots (the manifest flag off)."""
    out = models.converted("base")
    full = ortspec.Session(out)
    full.manifest.attention_window = False
    greedy = full.generate(PROMPTS, max_new_tokens=40)
    widths = []
    original = GraphRunner.run

    def recording(self, feeds, slot=None, wait=True):
        widths.extend(v.shape[-1] for n, v in read_inputs(feeds, slot).items() if n.startswith("key."))
        return original(self, feeds, slot, wait)

    monkeypatch.setattr(GraphRunner, "run", recording)
    session = ortspec.Session(out, num_speculative_tokens=3)
    assert session.generate(PROMPTS, max_new_tokens=40) == greedy
    max_length = session.manifest.max_length
    assert widths and all(w % 64 == 0 or w == max_length for w in widths)
    assert min(widths) == 64 and max(widths) < max_length



def test_every_window_covers_the_positions_its_graph_writes(models, monkeypatch):
    """A target forward writes its rows at their positions; the MTP head's draft passes write k-1
    slots past its last row. Every window must hold them (or be all max_length slots, where the
    graph clamps the drafts as it always did)."""
    out = models.converted("base")
    k, short = 3, []
    original = GraphRunner.run

    def checking(self, feeds, slot=None, wait=True):
        width = read_inputs(feeds, slot)["key.mtp" if self.name.startswith("mtp") else "key.3"].shape[-1]
        reach = k if self.name.startswith("mtp_propose") else 1
        if width < min(int(feeds["positions"].max()) + reach, max_length):
            short.append((self.name, width, int(feeds["positions"].max())))
        return original(self, feeds, slot, wait)

    session = ortspec.Session(out, num_speculative_tokens=k)
    max_length = session.manifest.max_length
    monkeypatch.setattr(GraphRunner, "run", checking)
    session.generate([p * 11 for p in PROMPTS], max_new_tokens=60)  # up to 187 + 60 tokens: windows 64..256
    assert short == []


def test_a_subset_of_rows_reads_its_window_in_place(models):
    """Rows 0 and 2 of 3 (the request between them finished): each KV feed is those rows' first W
    slots in one contiguous array that ONNX Runtime reads in place: the rows are moved into
    consecutive slots of the buffers (``RowSlots``), so the feed is a view of them, not a gather;
    every row keeps its own entries."""
    graphs = GraphSet(Manifest.load(models.converted("base")))
    target = TargetModel(graphs, batch=3)
    rng = np.random.default_rng(0)
    for cache in target.states.caches:
        cache.key[...] = rng.standard_normal(cache.key.shape)
        cache.value[...] = rng.standard_normal(cache.value.shape)
    before = [target.states.row_state(row, 64) for row in range(3)]
    want = {cache.names[0]: (cache.key[[0, 2]][..., :64], cache.value[[0, 2]][:, :, :64])
            for cache in target.states.caches}
    feeds = target.states.feeds(Rows([0, 2]), window=64)
    for cache in target.states.caches:
        key, value = feeds[cache.names[0]], feeds[cache.names[1]]
        assert key.flags.c_contiguous and value.flags.c_contiguous
        assert np.shares_memory(key, cache.key) and np.shares_memory(value, cache.value)
        assert np.array_equal(key, want[cache.names[0]][0]) and np.array_equal(value, want[cache.names[0]][1])
    for row in range(3):
        after = target.states.row_state(row, 64)
        assert all(np.array_equal(after[name], before[row][name]) for name in after)
