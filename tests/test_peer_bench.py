"""tools/peer_bench.py: rounds, comparisons, tables and JSON (timings never asserted); the
ortspec side on the CPU (--skip-peer, always); and, where onnxruntime-genai is installed (not a
project dependency; skipped otherwise), the builder's export and the whole harness with the
peer's runtime on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tools.peer import export, profile, report, rounds
from tools.peer.prompts import HELD_OUT_TEXTS, Prompt, load_prompts
from tools.peer.runners import StepCount
from tools.peer_bench import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-qwen35"
PEER_PATH = Path(os.environ.get("ORTSPEC_PEER_PATH") or ROOT / ".peer-cpu")


@pytest.fixture(autouse=True)
def restore_import_path(monkeypatch):
    """main() puts the peer's directory on sys.path and PYTHONPATH (for its builder subprocess)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))


class FakeRunner:
    """Emits prompt-derived tokens; `bad` raises on its n-th call (a configuration that breaks)."""

    def __init__(self, side="peer", offset=0, fail_on_call=None):
        self.side, self.offset, self.fail_on_call, self.calls = side, offset, fail_on_call, 0
        self.count = StepCount()

    def generate(self, prompt, max_new_tokens):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("CUDA failure: illegal address\nmore lines")
        self.count.steps += max_new_tokens
        self.count.tokens += max_new_tokens
        return [(sum(prompt) + self.offset + i) % 97 for i in range(max_new_tokens)]


PROMPTS = [Prompt("code", 0, [1, 2, 3]), Prompt("held_out", 0, [4, 5])]


def test_rounds_rotate_compare_and_survive_a_failing_configuration(capsys):
    runners = {"ortspec greedy": FakeRunner("ortspec"), "peer eager": FakeRunner(),
               "peer graph": FakeRunner(offset=1), "peer mtp N=1": FakeRunner(fail_on_call=3)}
    runs = rounds.run_rounds(runners, PROMPTS, max_new_tokens=4, rounds=3, budget_s=60)
    assert [len(r.round_seconds) for r in runs.values()] == [3, 3, 3, 0]
    assert runs["peer mtp N=1"].error == "round 1: RuntimeError: CUDA failure: illegal address"
    assert "peer mtp N=1 failed" in capsys.readouterr().out
    rows = {r["name"]: r for r in report.config_rows(runs, runners)}
    assert rows["peer eager"]["differs_from_ortspec_greedy"] == 0
    assert rows["peer graph"]["differs_from_ortspec_greedy"] == 2 and rows["peer graph"]["differs_from_peer_eager"] == 2
    assert rows["peer eager"]["tokens_per_second_min"] <= rows["peer eager"]["tokens_per_second"]
    assert rows["peer mtp N=1"]["rounds"] == 0 and "tokens_per_second" not in rows["peer mtp N=1"]


def test_rounds_stop_at_the_time_budget_but_run_one():
    runs = rounds.run_rounds({"peer eager": FakeRunner()}, PROMPTS, max_new_tokens=2, rounds=5, budget_s=0)
    assert len(runs["peer eager"].round_seconds) == 1


def test_tokens_that_change_between_rounds_are_counted():
    run = rounds.ConfigRun("x", "peer")
    run.record(0, [1, 2])
    run.record(0, [1, 3])
    run.record(1, [4])
    assert run.unstable == {0} and run.outputs[0] == [1, 2]


def test_busy_time_is_the_union_of_kernel_intervals():
    assert profile.busy_time([(5, 6), (0, 2), (1, 3), (1.5, 2.5)]) == 4
    assert profile.busy_time([]) == 0


def test_bandwidth_floor_of_tiny_counts_weights_kv_and_states():
    from safetensors.torch import load_file

    tensors = load_file(TINY / "model.safetensors")
    weights = sum(2 * t.numel() for n, t in tensors.items() if not n.startswith("mtp.") and "embed_tokens" not in n)
    floor = profile.floor_bytes_per_token(TINY, context=100)
    assert floor["weights"] == weights  # untied: a decode reads one embedding row, the lm_head whole
    assert floor["kv"] == 1 * 2 * 2 * 32 * 2 * 100  # 1 full layer, K and V, 2 kv heads, head_dim 32, fp16
    assert floor["states"] == 3 * (4 * 32 * 32 + (2 * 2 * 32 + 4 * 32) * 3) * 4 * 2
    assert floor["total"] == floor["weights"] + floor["kv"] + floor["states"]


def test_prompts_code_and_held_out_sets():
    prompts = load_prompts(TINY, 1024)
    assert [p.set for p in prompts] == ["code"] * 8 + ["held_out"] * 8
    assert len({tuple(p.ids) for p in prompts}) == 16
    synthetic = load_prompts(ROOT / "nowhere", 500, per_set=3)  # no tokenizer.json: fixed ids
    assert len(synthetic) == 6 and all(0 <= t < 500 for p in synthetic for t in p.ids)
    assert synthetic == load_prompts(ROOT / "nowhere", 500, per_set=3)
    others = [p for p in (ROOT / "tools").rglob("*.py") if "peer" not in p.parts and p.name != "peer_bench.py"]
    assert not any(HELD_OUT_TEXTS[0] in p.read_text() for p in others + list((ROOT / "ortspec").rglob("*.py")))


def test_write_json_leaves_no_partial_file(tmp_path):
    report.write_json({"a": 1}, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_bad_options_are_refused_before_any_work(tmp_path, capsys):
    cpu = ["--provider", "cpu", "--work", str(tmp_path)]
    assert main(["--k", "5", str(TINY), *cpu]) == 2
    assert "--k '5': values must be in 1..4" in capsys.readouterr().err
    assert main([str(TINY), "--max-length", "64", *cpu]) == 2
    assert "--max-length 64 is too small" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), *cpu]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(cpu) == 2 and "a checkpoint directory or --large" in capsys.readouterr().err
    assert main(["--report", str(tmp_path / "none.json")]) == 2
    assert "--report" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
    if not _has_cuda_ep():
        assert main([str(TINY), "--work", str(tmp_path)]) == 2  # the default provider is cuda
        assert "needs CUDAExecutionProvider" in capsys.readouterr().err


def _has_cuda_ep() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def test_ortspec_side_on_the_cpu_without_the_peer(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main([str(TINY), "--provider", "cpu", "--skip-peer", "--k", "2", "--prompts-per-set", "1",
                 "--max-new-tokens", "6", "--rounds", "2", "--work", str(tmp_path / "w"), "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| ortspec k=2 |" in table and "| peer " not in table
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["configs"]}
    assert set(rows) == {"ortspec greedy", "ortspec k=2"} and result["complete"] and result["rounds_done"] == 2
    assert rows["ortspec k=2"]["differs_from_ortspec_greedy"] == 0 and rows["ortspec k=2"]["prompts_compared"] == 2
    assert rows["ortspec k=2"]["tokens_per_step"] >= 1 and rows["ortspec greedy"]["tokens_per_step"] == 1
    assert main(["--report", str(out)]) == 0 and "| ortspec k=2 |" in capsys.readouterr().out
    again = [str(TINY), "--provider", "cpu", "--skip-peer", "--k", "", "--prompts-per-set", "1", "--max-new-tokens",
             "2", "--rounds", "1", "--work", str(tmp_path / "w"), "--json", str(out), "--reuse-exports"]
    assert main(again) == 0 and json.loads(out.read_text())["setup"]["reused_exports"] is True
    assert main(again + ["--max-length", "200"]) == 0 and json.loads(out.read_text())["setup"]["reused_exports"] is False


# -- with onnxruntime-genai (skipped where it is not installed) -----------------------------------

@pytest.fixture(scope="module")
def og():
    """onnxruntime_genai from PEER_PATH (where peer_bench looks by default) or the environment;
    the builder subprocess gets the same path through PYTHONPATH."""
    with pytest.MonkeyPatch.context() as mp:
        if PEER_PATH.is_dir():
            mp.syspath_prepend(str(PEER_PATH))
            mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PEER_PATH), os.environ.get("PYTHONPATH")])))
        module = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed "
                                     "(pip install --target .peer-cpu onnxruntime-genai==0.18.0 onnx-ir)")
        pytest.importorskip("onnx_ir")
        yield module


@pytest.fixture(scope="module")
def harness(og, tmp_path_factory):
    """One whole run with the peer on the CPU: builder export, MTP head directory, both runtimes.
    fp16 (the CUDA export with providers cleared): the peer's fp32 CPU export fails its MTP runs
    (test_fp32_cpu_export_runs_the_peers_fused_cpu_kernels)."""
    work = tmp_path_factory.mktemp("peer")
    code = main([str(TINY), "--provider", "cpu", "--precision", "fp16", "--k", "1", "--mtp", "1,2",
                 "--prompts-per-set", "1", "--max-new-tokens", "8", "--rounds", "1", "--work", str(work),
                 "--json", str(work / "r.json")])
    assert code == 0
    return work, json.loads((work / "r.json").read_text())


def test_builder_exports_main_model_mtp_head_and_graph_variants(og, harness):
    work, _ = harness
    built = work / "peer"
    for name in ("model.onnx", "model.onnx.data", "mtp.onnx", "mtp.onnx.data", "genai_config.json"):
        assert (built / name).exists(), name
    assert not (work / "peer.partial").exists()
    assert export.read_genai_config(built)["model"]["mtp"]["filename"] == "mtp.onnx"
    dirs = export.model_dirs(built, "cuda")  # what a GPU run loads
    assert sorted(p.name for p in dirs.head.iterdir()) == sorted(export.HEAD_FILES + export.SIDE_FILES
                                                               + ("genai_config.json",))
    assert (dirs.head / "model.onnx.data").stat().st_ino == (built / "model.onnx.data").stat().st_ino  # linked
    options = export.read_genai_config(dirs.graph_head)["model"]["decoder"]["session_options"]["provider_options"]
    assert options == [{"cuda": {"enable_cuda_graph": "1"}}]
    for path in (built, dirs.head, dirs.graph_main, dirs.graph_head, work / "peer_cpu", work / "peer_head_cpu"):
        og.Config(str(path))  # genai's own strict parser accepts every config written


def test_genai_refuses_an_unknown_key_so_the_parse_check_can_fail(og, harness, tmp_path):
    broken = shutil.copytree(harness[0] / "peer_head_cpu", tmp_path / "head")
    config = export.read_genai_config(broken)
    config["model"]["decoder"]["enabled"] = True  # what copying the mtp section whole would do
    (broken / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match='Unknown value "enabled"'):
        og.Config(str(broken))


def test_harness_runs_both_runtimes_and_compares_their_tokens(harness):
    _, result = harness
    rows = {r["name"]: r for r in result["configs"]}
    assert list(rows) == ["ortspec greedy", "ortspec k=1", "peer eager", "peer mtp N=1", "peer mtp N=2"]
    assert all(r["error"] is None and r["rounds"] == 1 and r["prompts_compared"] == 2 for r in rows.values())
    assert rows["ortspec k=1"]["differs_from_ortspec_greedy"] == 0
    assert all(rows[n]["differs_from_peer_eager"] is not None for n in ("peer mtp N=1", "peer mtp N=2"))
    assert rows["peer mtp N=2"]["tokens_per_step"] >= 1 and result["notes"]


def test_fp32_cpu_export_runs_the_peers_fused_cpu_kernels(og, tmp_path):
    """--provider cpu (default fp32): the builder's CPU export (LinearAttention and the other fused
    CPU kernels), one intra-op thread on both sides, ortspec's float32 CPU graphs; same tokens.
    (The peer's MTP head of that export fails in its own runtime, 0.18: "Cast - input and output
    types are the same"; the harness reports that configuration's error and goes on.)"""
    import onnx

    code = main([str(TINY), "--provider", "cpu", "--threads", "1", "--k", "", "--mtp", "", "--prompts-per-set", "1",
                 "--max-new-tokens", "8", "--rounds", "1", "--work", str(tmp_path), "--json", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["name"]: r for r in result["configs"]}
    assert code == 0 and (result["precision"], result["threads"]) == ("fp32", 1)
    assert rows["peer eager"]["error"] is None and rows["peer eager"]["differs_from_ortspec_greedy"] == 0
    assert rows["ortspec greedy"]["tokens_per_cpu_second"] > 0
    ops = {n.op_type for n in onnx.load(str(tmp_path / "peer" / "model.onnx"), load_external_data=False).graph.node}
    assert {"LinearAttention", "CausalConvWithState", "GroupQueryAttention"} <= ops
    options = export.read_genai_config(tmp_path / "peer_cpu")["model"]["decoder"]["session_options"]
    assert options["intra_op_num_threads"] == 1 and (tmp_path / "ortspec_fp32" / "decode.cpu.onnx").exists()
