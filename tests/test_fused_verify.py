"""One Run per greedy speculative step: verify_mtp_k{k} (the verify, the greedy acceptance and the
MTP head's catch-up in one graph) computes what the two graphs it replaces compute, bit for bit;
steps run with it equal a plain decode bitwise; a bug planted in it is caught; and every step it
cannot serve (sampled requests, another next k, readvance, exact mode, older models) runs as before."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec import InternalError, converter
from ortspec.converter import fused_graph
from ortspec.runtime.graph_slots import SlotKey, is_captured_graph
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.kv_window import window_slots
from ortspec.speculative.exactness import ExactnessError, check_speculative, plain_decode_states
from ortspec.speculative.step_kinds import FusedSteps
from ortspec.speculative.sampling import accept_lengths
from tests.test_auto_k import ScriptedK

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def convert_base(models, out, patches: dict):
    """The base checkpoint converted with K=2 into out, with converter functions patched:
    patches {(module, name): replacement}."""
    with pytest.MonkeyPatch.context() as patch:
        for (module, name), value in patches.items():
            patch.setattr(module, name, value)
        return ortspec.convert(models.checkpoint("base"), out, num_speculative_tokens=2, max_length=64,
                               progress=False)


# -- the graph ------------------------------------------------------------------------------------

def verify_feeds(graphs, ids, positions, rng):
    """Random finite states for B rows; the target's caches whole, the head's in a narrower window
    (the graph's two window dimensions W and Wm are its own)."""
    m = graphs.manifest
    feeds = {"input_ids": ids, "positions": positions}
    for name, entry in m.states.items():
        shape = [len(ids)] + entry["shape"][1:]
        feeds[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    window = window_slots(m.max_length, int(positions.max()), reach=positions.shape[1])
    feeds["key.mtp"], feeds["value.mtp"] = feeds["key.mtp"][..., :window], feeds["value.mtp"][:, :, :window]
    return feeds


def drafts_accepting(graphs, k, feeds, lengths):
    """input_ids whose drafts match the target's argmaxes for exactly lengths[j] drafts in row j:
    d_{i+1} := g_i for i < a, then a wrong d_{a+1} (g_i depends on ids up to i only)."""
    ids = feeds["input_ids"].copy()
    for i in range(k):
        tokens = graphs[f"verify_select_k{k}"].run({**feeds, "input_ids": ids})["tokens"]
        for j, a in enumerate(lengths):
            ids[j, i + 1] = tokens[j, i] if i < a else (tokens[j, i] + 1) % graphs.manifest.spec.vocab_size
    return ids


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fused_graph_computes_what_the_two_graphs_do(models, k):
    """verify_mtp_k{k}'s verify outputs equal verify_select_k{k}'s, its accept lengths the host rule's,
    and its head outputs mtp_propose_k{k}'s fed the verify's tokens and accept lengths: all bitwise."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    rng = np.random.default_rng(k)
    lengths = [0, k, k // 2, min(1, k)]  # accept lengths, one per row
    positions = np.array([[t + i for i in range(k + 1)] for t in (3, 40, 17, 99)], np.int64)  # [B, k+1]
    feeds = verify_feeds(graphs, rng.integers(0, graphs.manifest.spec.vocab_size, (4, k + 1)), positions, rng)
    feeds["input_ids"] = drafts_accepting(graphs, k, feeds, lengths)
    fused = graphs[f"verify_mtp_k{k}"].run(feeds)
    verify = graphs[f"verify_select_k{k}"].run(feeds)
    for name, value in verify.items():
        assert np.array_equal(fused[name], value), name
    assert fused["accepted"].tolist() == lengths
    assert np.array_equal(fused["accepted"], accept_lengths(feeds["input_ids"][:, 1:], verify["tokens"]))
    head = graphs[f"mtp_propose_k{k}"].run({"input_ids": verify["tokens"], "hidden": verify["hidden"],
                                             "positions": positions, "last": fused["accepted"],
                                             "key.mtp": feeds["key.mtp"], "value.mtp": feeds["value.mtp"]})
    for name in ("drafts", "new_key.mtp", "new_value.mtp"):
        assert np.array_equal(fused[name], head[name]), name
    assert np.array_equal(fused["step_ids"], np.concatenate([verify["tokens"], fused["accepted"][:, None],
                                                              head["drafts"]], axis=1))


def test_the_fused_graph_is_captured_under_its_own_slot_key():
    """On CUDA it replays as a graph of its own: captured (fixed shape, like the verifies), and keyed
    apart from verify_select_k{k} over the same engine's buffers."""
    ids = np.zeros((4, 4), np.int64)
    assert is_captured_graph("verify_mtp_k3")
    assert SlotKey.for_run("verify_mtp_k3", ids, 0) != SlotKey.for_run("verify_select_k3", ids, 0)


# -- steps ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["base", "mixed"])
def test_one_run_and_two_run_steps_equal_plain_decode(models, config):
    """Scripted drafts drive every accept length; after every commit the target's and the head's
    states and next drafts equal the plain decode's bitwise, with the head inside the verify's graph
    (every step) and in its own Run (none); fixed rows (CUDA's batching) too."""
    graphs = GraphSet(ortspec.Session(models.converted(config)).manifest)
    for k in (1, 3):
        reference = plain_decode_states(graphs, PROMPTS, 40 + k + 1, k)
        for fused, fixed_rows in ((True, None), (False, None), (True, True)):
            stats = check_speculative(graphs, PROMPTS, 40, k, "select", seed=k, reference=reference,
                                      fixed_rows=fixed_rows, fused_verify=fused)
            assert stats.fused_verify_steps == (stats.speculative_steps if fused else 0)
            assert min(stats.accept_histogram) > 0, stats.accept_histogram


def test_auto_k_fuses_only_where_the_next_k_is_this_one(models):
    """A step whose next k differs (auto k) runs the head in its own Run to draft that many; the
    others run as one graph; states stay the plain decode's throughout."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    reference = plain_decode_states(graphs, PROMPTS, 60 + 4 + 1, 4)
    stats = check_speculative(graphs, PROMPTS, 60, 4, "select", p=0.7, seed=5, reference=reference,
                              k_chooser=ScriptedK(4, [2, 2, 2, 3, 3, 0, 4, 4, 1]))
    assert 0 < stats.fused_verify_steps < stats.speculative_steps, (stats.fused_verify_steps, stats.speculative_steps)


def test_readvance_and_exact_steps_run_two_graphs_sampled_ones_fuse(models):
    """Fused with select, outside exact mode; sampled requests too (verify_mtp_sample_k{k}), also
    beside a greedy one; a model converted without the sampling graphs runs those in two."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    greedy = ortspec.Session(models.converted("base")).generate(PROMPTS, max_new_tokens=12)
    assert session.generate(PROMPTS, max_new_tokens=12) == greedy and session.stats["fused_verify_steps"] > 0
    session.reset_stats()
    session.generate(PROMPTS, max_new_tokens=12, fused_verify=False)
    assert session.stats["fused_verify_steps"] == 0 and session.stats["speculative_steps"] > 0
    session.reset_stats()
    session.generate(PROMPTS, max_new_tokens=12, temperature=0.8, seed=1)
    assert session.stats["fused_verify_steps"] == session.stats["speculative_steps"] > 0
    session.reset_stats()
    with session.batcher(max_batch_size=2) as batcher:  # one sampled request beside a greedy one
        a = batcher.add_request(PROMPTS[0], max_new_tokens=8)
        batcher.add_request(PROMPTS[1], max_new_tokens=8, temperature=0.8, seed=2)
        while batcher.pending:
            batcher.step()
        assert batcher.result(a) == greedy[0][:8]  # the greedy row beside it: the greedy rule, in the graph
    assert session.stats["fused_verify_steps"] > 0
    for other in (dict(commit="readvance"), dict(exact=True, exact_batch_size=1)):
        session = ortspec.Session(models.converted("base"), num_speculative_tokens=2, **other)
        assert session.generate(PROMPTS, max_new_tokens=12) == greedy
        assert session.stats["fused_verify_steps"] == 0, other


def test_a_model_converted_without_the_graph_runs_two_graphs(models, tmp_path):
    """Models converted before verify_mtp_k{k} existed: the same tokens, every step in two Runs."""
    builders = converter._graph_builders
    out = convert_base(models, tmp_path / "old", {(converter, "_graph_builders"): lambda *a: {
        name: build for name, build in builders(*a).items() if not name.startswith("verify_mtp")}})
    session = ortspec.Session(out, num_speculative_tokens=2)
    assert not any(name.startswith("verify_mtp") for name in session.manifest.graphs)
    assert session.generate(PROMPTS, max_new_tokens=20) == ortspec.Session(out).generate(PROMPTS, max_new_tokens=20)
    assert session.stats["fused_verify_steps"] == 0 and session.stats["speculative_steps"] > 0


# -- planted bugs -------------------------------------------------------------------------------------

GREEDY_ACCEPTANCE = fused_graph.make_greedy_acceptance


def accepting_one_too_many(g, ids, tokens, k):
    """Planted: the graph's accept length one past the greedy rule's (at most k)."""
    accepted = GREEDY_ACCEPTANCE(g, ids, tokens, k)
    return g.op("Min", [g.op("Add", [accepted, g.const(1)]), g.const(k)])


@pytest.fixture(scope="module")
def off_by_one(tmp_path_factory, models):
    return convert_base(models, tmp_path_factory.mktemp("off_by_one") / "out",
                        {(fused_graph, "make_greedy_acceptance"): accepting_one_too_many})


def test_an_off_by_one_acceptance_in_the_graph_is_refused(off_by_one):
    """The host's rule disagrees with the graph's: InternalError as the step is read (its commit ran
    on the device: its rows are wrong until a prefill resets them), and the Session still generates
    (the head in its own Run)."""
    session = ortspec.Session(off_by_one, num_speculative_tokens=2)
    greedy = ortspec.Session(off_by_one).generate(PROMPTS, max_new_tokens=16)
    with pytest.raises(InternalError, match=r"verify_mtp_k2 accepted .* where the greedy rule accepts"):
        session.generate(PROMPTS, max_new_tokens=16)
    assert session.generate(PROMPTS, max_new_tokens=16, fused_verify=False) == greedy


def test_the_state_check_catches_it_without_the_host_rule(off_by_one, monkeypatch):
    """With the host's cross-check planted away too, the head's entries and drafts come from the
    wrong row, and the state comparison with the plain decode fails."""
    monkeypatch.setattr(FusedSteps, "check_acceptance", lambda self, accepted, drafts, tokens: None)
    graphs = GraphSet(ortspec.Session(off_by_one).manifest)
    with pytest.raises(ExactnessError, match="MTP state|next drafts"):
        check_speculative(graphs, PROMPTS, 16, 2, "select", p=0.5)


def test_a_head_fed_the_verify_inputs_is_caught(models, tmp_path):
    """Planted: the head reads x_p (the verify's own inputs) where it must read x_{p+1} (its argmaxes)."""
    original = fused_graph.add_mtp_propose
    out = convert_base(models, tmp_path / "shifted", {(fused_graph, "add_mtp_propose"): lambda g, spec, L, k, ids, *rest:
                                                      original(g, spec, L, k, "input_ids", *rest)})
    graphs = GraphSet(ortspec.Session(out).manifest)
    with pytest.raises(ExactnessError, match="MTP state"):
        check_speculative(graphs, PROMPTS, 16, 2, "select", p=0.5)
