"""The transition-record commit (convert gdn_verify="transition"): the native replay and conv-tail
kernels and their numpy twins (runtime.arrays.HostArrays) against a float64 recurrence, against the
per-row verify's own states, and the whole select commit (runtime.states) in the speculative loop,
on the CPU with the portable graphs (the transition form's graphs run there; only CUDA uses them).

Shapes: B requests, M verify rows, nk key heads, nv value heads (a multiple of nk), dk, dv.
"""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec._native_loader import load_native
from ortspec.manifest import Manifest, record_names
from ortspec.runtime.arrays import HostArrays
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import TargetModel
from ortspec.runtime.states import Rows
from ortspec.speculative.exactness import ExactnessError, check_speculative, plain_decode_states
from tests.conftest import K, MAX_LENGTH
from tools.gpu_suite.gdn_verify import float64_replay, random_record, relative_error

native = load_native()
needs_cuda_device = pytest.mark.skipif(
    not native.cuda_available(), reason=f"no usable CUDA device: {native.build_info()['cuda_unavailable_reason']}")
PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7]]
ATOL = 1e-5  # the GPU checks' state tolerance (x (1 + max |state|)): the replay rounds unlike LinearAttention


@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 3)], ids=["equal", "inverse_gqa", "odd"])
def test_replay_matches_a_float64_recurrence(heads):
    """Native and numpy replays, two layers in one call, counts from none to every row."""
    rng = np.random.default_rng(sum(heads))
    layers = [random_record(rng, key_heads=heads[0], value_heads=heads[1]) for _ in range(2)]
    counts = np.array([4, 0, 2], np.int64)
    native_states, host_states = [l[0].copy() for l in layers], [l[0].copy() for l in layers]
    records = [[layer[i] for layer in layers] for i in range(1, 5)]
    native.replay_transitions(native_states, *records, counts)
    HostArrays().replay_transitions(host_states, *records, counts)
    for layer, got_native, got_host in zip(layers, native_states, host_states):
        want = float64_replay(*layer, counts)
        assert relative_error(got_native, want) < 1e-6 and relative_error(got_host, want) < 1e-6
        np.testing.assert_array_equal(got_native[1], layer[0][1])  # count 0: untouched


def test_conv_tails_keep_the_last_inputs_bit_for_bit():
    rng = np.random.default_rng(5)
    tail, inputs = rng.standard_normal((4, 3, 6)).astype(np.float32), rng.standard_normal((4, 5, 6)).astype(np.float32)
    counts = np.array([0, 1, 3, 5], np.int64)
    want = np.stack([np.concatenate([tail[b], inputs[b]])[n: n + 3] for b, n in enumerate(counts)])
    for commit in (native.commit_conv_tails, HostArrays().commit_conv_tails):
        got = tail.copy()
        commit([got], [inputs], counts)
        np.testing.assert_array_equal(got, want)


def test_a_count_past_the_verify_rows_is_refused_and_nothing_is_written():
    rng = np.random.default_rng(7)
    state, *record = random_record(rng)
    bad = np.array([1, 5, 0], np.int64)
    for replay in (native.replay_transitions, HostArrays().replay_transitions):
        live = state.copy()
        with pytest.raises(ValueError, match=r"counts\[1\]=5 is out of range 0..M=4"):
            replay([live], *([r] for r in record), bad)
        np.testing.assert_array_equal(live, state)
    with pytest.raises(ValueError, match="replay_transitions: 1 keys for 2 states"):
        native.replay_transitions([state, state.copy()], [record[0]], [record[1]] * 2, [record[2]] * 2,
                                  [record[3]] * 2, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"layer 0: values must be \[B, M, nv\*dv\] = \[3, 4, 24\], got \[3, 4, 23\]"):
        native.replay_transitions([state], [record[0]], [record[1][..., :23].copy()], [record[2]], [record[3]],
                                  np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="layer 0: decay must be float32, got float16"):
        native.replay_transitions([state], [record[0]], [record[1]], [record[2].astype(np.float16)], [record[3]],
                                  np.zeros(3, np.int64))


@needs_cuda_device
def test_cuda_replay_and_tails_match_the_cpu_at_qwen35_sizes():
    """Three layers of Qwen3.5-0.8B's GDN (nk = nv = 16, dk = dv = 128) in one launch each, batch 3,
    counts from the device, against the CPU kernels; a bad count is recorded, that request unchanged."""
    rng = np.random.default_rng(13)
    device = native.PersistentBuffers(device="cuda")

    def upload(name, array):
        buffer = device.allocate(name, array.shape, array.dtype)
        buffer.copy_from_numpy(np.ascontiguousarray(array))
        return buffer

    layers = [random_record(rng, batch=3, rows=5, key_heads=16, value_heads=16, key_dim=128, value_dim=128)
              for _ in range(3)]
    counts = np.array([5, 0, 3], np.int64)
    on_device = [[upload(f"{i}.{l}", part) for i, part in enumerate(layer)] for l, layer in enumerate(layers)]
    native.replay_transitions(*([layer[i] for layer in on_device] for i in range(5)), upload("counts", counts))
    tails, inputs = rng.standard_normal((3, 3, 8192)).astype(np.float32), rng.standard_normal((3, 5, 8192)).astype(np.float32)
    tail_gpu = upload("tail", tails)
    native.commit_conv_tails([tail_gpu], [upload("inputs", inputs)], device["counts"])
    native.check_device_errors()
    for layer, got in zip(layers, on_device):
        want = layer[0].copy()
        native.replay_transitions([want], *([p] for p in layer[1:]), counts)
        assert relative_error(got[0].to_numpy(), want) < 1e-5
    want_tail = tails.copy()
    native.commit_conv_tails([want_tail], [inputs], counts)
    np.testing.assert_array_equal(tail_gpu.to_numpy(), want_tail)
    native.commit_conv_tails([tail_gpu], [device["inputs"]], upload("bad", np.array([1, 6, 0], np.int64)))
    with pytest.raises(ValueError, match=r"commit_conv_tails: counts\[1\]=6 is out of range 0..M=5"):
        native.check_device_errors()
    np.testing.assert_array_equal(tail_gpu.to_numpy()[1], want_tail[1])


@pytest.fixture(scope="module")
def transition_pair(models, tmp_path_factory):
    """The "base" checkpoint converted per row and with transition records, each manifest without its
    CPU variants (the CPU then runs the portable graphs, as a CUDA Session does)."""
    root = tmp_path_factory.mktemp("transition")
    manifests = {}
    for form in ("per_row", "transition"):
        out = ortspec.convert(models.checkpoint("base"), root / form, num_speculative_tokens=K, max_length=MAX_LENGTH,
                              mtp_quant="none", gdn_verify=form, progress=False)
        manifests[form] = Manifest.load(out)
        for entry in manifests[form].graphs.values():
            entry.pop("cpu", None)
    return manifests


def verify_outputs(manifest, ids, positions):
    """A prefill of PROMPTS[0] twice (2 requests), then a verify_select_k{M-1} over ids / positions
    [2, M]: (the outputs, the live states before the verify)."""
    target, rows = TargetModel(GraphSet(manifest), batch=2), Rows([0, 1])
    prompt = np.array([PROMPTS[0]] * 2)
    target.prefill(rows, prompt, np.broadcast_to(np.arange(prompt.shape[1]), prompt.shape))
    before = {s.names[0]: s.buffer.copy() for s in target.states.layers}
    return target.verify_windows(rows, ids, positions), before


def test_replaying_the_record_reaches_the_per_row_verifys_own_states(transition_pair):
    """Both verifies of one model over the same rows: replaying the first a+1 rows of the record onto
    the pre-verify state gives the per-row graph's state after row a (LinearAttention's own), within
    1e-6 (the recurrent state) and bit for bit (the conv tail), for every a, by both replays."""
    ids = np.array([[3, 250, 99, 17, 5], [7, 7, 300, 2, 1]])
    positions = np.broadcast_to(np.arange(7, 12), ids.shape)
    windows, before = verify_outputs(transition_pair["per_row"], ids, positions)
    record, same_before = verify_outputs(transition_pair["transition"], ids, positions)
    np.testing.assert_array_equal(windows["logits"], record["logits"])  # the verify's tokens are the same
    for name, state in before.items():
        np.testing.assert_array_equal(state, same_before[name])
        window = windows[f"{name.split('.')[0]}_window.{name.split('.')[1]}"]  # [M, B, ...]
        parts = [record[n] for n in record_names(name)]
        for a in range(ids.shape[1]):
            counts = np.full(2, a + 1, np.int64)
            for replay in ((native.replay_transitions, HostArrays().replay_transitions) if name.startswith("recurrent")
                           else (native.commit_conv_tails, HostArrays().commit_conv_tails)):
                live = state.copy()
                replay([live], *([p] for p in parts), counts)
                if name.startswith("recurrent"):
                    assert relative_error(live, window[a]) < 1e-6, (name, a)
                else:
                    np.testing.assert_array_equal(live, window[a])


def test_a_subset_of_rows_commits_as_the_per_row_select_does(transition_pair):
    """Rows 0 and 2 of 3 (what the CPU runs once the middle request finished): the transition commit
    and the per-row select leave the same states (within 1e-6; conv tails and KV bit for bit), and
    row 1 as it was."""
    ids = np.array([[3, 250, 99, 17], [7, 7, 300, 2]])
    positions = np.broadcast_to(np.arange(7, 11), ids.shape)
    accepted = np.array([1, 3])
    states = {}
    for form, manifest in transition_pair.items():
        target, prompt = TargetModel(GraphSet(manifest), batch=3), np.array([PROMPTS[0]] * 3)
        target.prefill(Rows([0, 1, 2]), prompt, np.broadcast_to(np.arange(prompt.shape[1]), prompt.shape))
        untouched = target.states.row_state(1, 7)
        out = target.verify_windows(Rows([0, 2]), ids, positions)
        target.select(out, Rows([0, 2]), positions, accepted)
        states[form] = [target.states.row_state(row, 7 + 4) for row in range(3)]
        assert all(np.array_equal(v, untouched[n]) for n, v in target.states.row_state(1, 7).items())
    for per_row, replayed in zip(states["per_row"], states["transition"]):
        for name, want in per_row.items():
            if name.startswith("recurrent"):
                assert relative_error(replayed[name], want) < 1e-6, name
            else:
                np.testing.assert_array_equal(replayed[name], want)


@pytest.mark.parametrize("fused", [True, False], ids=["one_run", "two_runs"])
def test_speculative_states_equal_a_plain_decode_with_transition_records(transition_pair, fused):
    """The select commit through runtime.states: states after every commit within ATOL of a plain
    decode (the replay rounds unlike LinearAttention: not bitwise), k = 1, 2, 4, scripted drafts, rows
    that finish and leave and fixed rows; tokens equal greedy."""
    graphs = GraphSet(transition_pair["transition"])
    for k in (1, 2, 4):
        reference = plain_decode_states(graphs, PROMPTS, 16 + k + 1, k)
        for fixed_rows in (False, True):
            stats = check_speculative(graphs, PROMPTS, 16, k, "select", p=0.6, seed=k, reference=reference,
                                      atol=ATOL, fused_verify=fused, fixed_rows=fixed_rows)
            assert stats.speculative_row_steps > 0


def test_planted_bug_a_tail_one_row_late_is_caught(transition_pair, monkeypatch):
    """The check is not blind to the conv tail: a commit that keeps one row too many fails."""
    commit = HostArrays.commit_conv_tails
    monkeypatch.setattr(HostArrays, "commit_conv_tails",
                        lambda self, tails, inputs, counts: commit(self, tails, inputs,
                                                                   np.minimum(np.asarray(counts) + 1, inputs[0].shape[1])))
    with pytest.raises(ExactnessError, match="target state conv"):
        check_speculative(GraphSet(transition_pair["transition"]), PROMPTS, 16, 3, "select", p=0.6, atol=ATOL)
