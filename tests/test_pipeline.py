"""Pipeline stages: the layers split into stage graphs that hand proxy tensors on. Output and
states equal the single-stage model's; an absent proxy is skipped, not indexed."""

from __future__ import annotations

import pytest

import ortspec
from ortspec.runtime import model as runtime_model
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.exactness import check_speculative, plain_decode_states
from tools.make_tiny_checkpoint import make_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    make_checkpoint(root / "ck", seed=41, layer_types=("linear_attention", "full_attention", "linear_attention",
                                                       "linear_attention", "full_attention"))
    ortspec.convert(root / "ck", root / "two", num_speculative_tokens=3, max_length=128, pipeline_stages=2,
                    progress=False)
    ortspec.convert(root / "ck", root / "empty_first", num_speculative_tokens=2, max_length=128,
                    stage_layers=[0, 0, 5], progress=False)
    return root


def test_two_stages_equal_one(staged):
    reference = ortspec.Session(staged / "two").generate(PROMPTS, max_new_tokens=30)
    for k, commit in ((0, "select"), (2, "select"), (3, "readvance")):
        session = ortspec.Session(staged / "two", pipeline_stages=2, num_speculative_tokens=k, commit=commit)
        assert session.generate(PROMPTS, max_new_tokens=30) == reference, (k, commit)


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_staged_states_equal_unstaged_plain_decode(staged, commit):
    """Every state after every commit of a 2-stage speculative run equals (bitwise) the
    single-stage plain decode's: the stage boundary changes no bit."""
    graphs = GraphSet(ortspec.Session(staged / "two").manifest)
    reference = plain_decode_states(graphs, PROMPTS, 40 + 3 + 1, 3, stages=1)
    stats = check_speculative(graphs, PROMPTS, 40, 3, commit, p=0.6, reference=reference, stages=2)
    assert stats.speculative_row_steps > 20


def test_absent_residual_proxy_is_skipped(staged):
    """Stage 0 holds no layer, so it hands on the embedding and no residual."""
    reference = ortspec.Session(staged / "two").generate(PROMPTS, max_new_tokens=20)
    session = ortspec.Session(staged / "empty_first", pipeline_stages=2, num_speculative_tokens=2)
    assert session.generate(PROMPTS, max_new_tokens=20) == reference


def test_indexing_an_absent_proxy_fails(staged, monkeypatch):
    """Planted: forwarding both proxies unconditionally breaks the empty-first-stage model."""
    monkeypatch.setattr(runtime_model, "proxies", lambda out: {n: out[n] for n in ("proxy.hidden", "proxy.residual")})
    session = ortspec.Session(staged / "empty_first", pipeline_stages=2)
    with pytest.raises(KeyError, match="proxy.residual"):
        session.generate(PROMPTS, max_new_tokens=4)


def test_stage_errors(staged):
    with pytest.raises(ortspec.ConfigurationError, match="reconvert with --pipeline-stages 3"):
        ortspec.Session(staged / "two", pipeline_stages=3)
    with pytest.raises(ortspec.ConfigurationError, match="one device per pipeline stage"):
        ortspec.Session(staged / "two", pipeline_stages=2, devices=[0])
    with pytest.raises(ortspec.CheckpointError, match="must rise from 0"):
        ortspec.convert(staged / "ck", staged / "bad", stage_layers=[0, 3, 2, 5], progress=False)


def test_stages_on_two_devices_equal_one(staged):
    """devices=[0, 1]: each stage's states live with its device's arrays and the proxies are
    handed over into the next device's buffers (on the CPU both are host memory, so this checks
    the placement and the hand-over; the peer copy itself is checked on a two-GPU host)."""
    reference = ortspec.Session(staged / "two").generate(PROMPTS, max_new_tokens=30)
    for k, commit in ((0, "select"), (3, "select"), (2, "readvance")):
        session = ortspec.Session(staged / "two", pipeline_stages=2, devices=[0, 1], num_speculative_tokens=k,
                                  commit=commit)
        assert session.generate(PROMPTS, max_new_tokens=30) == reference, (k, commit)
    with session.lease_engine(len(PROMPTS)) as engine:  # the engine the last generate call used, now free
        target, mtp = engine.target, engine.mtp
    bounds = session.manifest.stage_layers
    for kind in target.states.kinds:
        layer = session.manifest.states[kind.names[0]]["layer"]
        assert kind.arrays.device_index == (0 if layer < bounds[1] else 1), kind.names
    assert all(kind.arrays.device_index == 1 for kind in mtp.states.kinds)
    received = target.hand_overs[0]._slot_buffers
    assert received and all(name == "proxy.hidden" or name == "proxy.residual" for _, name in received)


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_states_on_two_devices_equal_unstaged_plain_decode(staged, commit):
    graphs = GraphSet(ortspec.Session(staged / "two").manifest)
    reference = plain_decode_states(graphs, PROMPTS, 30 + 3 + 1, 3, stages=1)
    two_devices = GraphSet(graphs.manifest, devices=[0, 1])
    stats = check_speculative(two_devices, PROMPTS, 30, 3, commit, p=0.6, reference=reference, stages=2)
    assert stats.speculative_row_steps > 15


def test_device_errors(staged):
    with pytest.raises(ortspec.ConfigurationError, match="must be a list of device indices"):
        ortspec.Session(staged / "two", pipeline_stages=2, devices=[0, "1"])
    with pytest.raises(ortspec.ConfigurationError, match=r"one device per pipeline stage \(2\); e.g. devices=\[0, 1\]"):
        ortspec.Session(staged / "two", pipeline_stages=2, devices=[0, 1, 2])


def test_devices_beyond_the_machine_are_refused(staged, monkeypatch):
    """On CUDA every device must exist; checked before any session or buffer is made."""
    from ortspec import session as session_module

    class OneGpu:
        def build_info(self):
            return {"cuda_device_count": 1}

    monkeypatch.setattr(session_module, "check_provider", lambda provider: None)
    monkeypatch.setattr(session_module, "load_native", lambda: OneGpu())
    with pytest.raises(ortspec.ConfigurationError, match=r"names cuda:1, but this machine has 1 CUDA device;"):
        ortspec.Session(staged / "two", provider="cuda", pipeline_stages=2, devices=[0, 1])


def test_a_stale_hand_over_is_caught(staged, monkeypatch):
    """Planted: the receiving device's buffer of a graph slot is filled on the slot's first
    step only (a pre-planned path that skips the refresh); the state check must fail."""
    from ortspec.speculative.exactness import ExactnessError

    filled = set()

    def stale(self, proxies, slot):
        received = {}
        for name, value in proxies.items():
            if slot is None:  # eager runs (prefill) stay right
                received[name] = value
                continue
            key = (slot, name)
            if key not in filled:
                self._slot_buffers[key] = self.arrays.zeros(value.shape, value.dtype)
                self.arrays.copy(self._slot_buffers[key], value)
                filled.add(key)
            received[name] = self._slot_buffers[key]
        return received

    monkeypatch.setattr(runtime_model.HandOver, "__call__", stale)
    graphs = GraphSet(ortspec.Session(staged / "two").manifest)
    reference = plain_decode_states(graphs, PROMPTS, 20 + 3 + 1, 3, stages=1)
    with pytest.raises(ExactnessError):
        check_speculative(GraphSet(graphs.manifest, devices=[0, 1]), PROMPTS, 20, 3, "select", p=0.6,
                          reference=reference, stages=2)
