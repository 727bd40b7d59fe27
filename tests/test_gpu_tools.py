"""tools/gpu.py on a machine without a GPU: every subcommand imports and parses its options,
the host script maps the former script names onto subcommands, and the parts that need no
GPU (tables, byte counts, the identity helper, the CPU host profile, packing) run."""

from __future__ import annotations

import argparse
import json
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

import ortspec
import ortspec.runtime.forward_shapes

from tools import gpu
from tools.gpu_suite import ab, agree, batch, common, exact, exact_prompts, gdn_verify, pipeline, scale, trained

HOST_SCRIPT = Path(gpu.ROOT) / "tools" / "gpu_host.sh"


def test_every_subcommand_has_help_with_every_option_described(capsys):
    with pytest.raises(SystemExit) as top:
        gpu.main(["--help"])
    listing = capsys.readouterr().out
    assert top.value.code == 0 and all(name in listing for name in gpu.SUBCOMMANDS)
    parser = gpu.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in subparsers.items():
        with pytest.raises(SystemExit) as help_exit:
            gpu.main([name, "--help"])
        assert help_exit.value.code == 0
        text = capsys.readouterr().out
        for action in sub._actions:
            if "-h" not in action.option_strings:
                assert action.help, f"gpu.py {name} {action.option_strings or action.dest} has no help"
                assert (action.option_strings or [action.dest])[0] in text


def test_options_parse_with_their_defaults(monkeypatch):
    parse = gpu.build_parser().parse_args
    assert parse(["check", "--no-bench"]).no_bench and parse(["check"]).new_tokens == 64
    assert parse(["profile"]).model == "/tmp/trained_fp16" and parse(["profile", "-k", "0,2"]).k == "0,2"
    assert parse(["ab", "m"]).bench_args == ab.DEFAULT_BENCH_ARGS
    monkeypatch.setenv("AB_ARGS", "--k 0,1")  # the environment sets the default, as gpu_ab.sh's AB_ARGS did
    assert gpu.build_parser().parse_args(["ab", "m"]).bench_args == "--k 0,1"
    assert parse(["batch", "--json", "r.json"]).json == "r.json"


@pytest.mark.parametrize("name,subcommand", [("check", "check"), ("gpu_check", "check"), ("gpu_batch_check", "batch"),
                                             ("gpu_pipeline", "pipeline"), ("gpu_scale", "scale"),
                                             ("gpu_host_profile", "profile"), ("trained", "trained"),
                                             ("agree", "agree")])
def test_host_script_maps_names_to_subcommands(name, subcommand):
    script = HOST_SCRIPT.read_text()
    case = script[script.index('  case "$tool" in'):script.index("  esac") + len("  esac")]
    mapped = subprocess.run(["bash", "-c", f"tool={name}\n{case}\necho $tool"], capture_output=True, text=True)
    assert mapped.stdout.strip() == subcommand and subcommand in gpu.SUBCOMMANDS
    assert subprocess.run(["bash", "-n", str(HOST_SCRIPT)]).returncode == 0


def test_identity_helper_on_the_cpu(models):
    same = common.speculative_matches_greedy(models.converted("base"), common.SHORT_PROMPTS, 10, provider="cpu",
                                             ks=(1, 3))
    assert same == {("select", 1): True, ("select", 3): True, ("readvance", 1): True, ("readvance", 3): True}
    assert common.identity_lines("int4", same).splitlines() == [
        "int4 select: speculative == greedy for k=1..4: [True, True]",
        "int4 readvance: speculative == greedy for k=1..4: [True, True]"]


def test_checks_count_failures():
    checks = common.Checks()
    assert checks.record("a", True) and not checks.record("b", False)
    checks.fail(False)
    checks.fail()
    assert checks.failures == 2 and checks.results == {"a": True, "b": False} and checks.exit_status() == 1


def bench_row(k, batch_size, tokens_per_second, verify_ms=0.0, decode_ms=0.0, steps=10):
    return {"k": k, "batch": batch_size, "tokens_per_second": tokens_per_second, "mean_tokens_per_step": 1 + k / 2,
            "phase_ms": {"decode": decode_ms, "verify": verify_ms}, "decode_steps": steps if k == 0 else 0,
            "speculative_steps": steps if k else 0}


def test_tables():
    rows = [bench_row(0, 1, 100, decode_ms=10)] + [bench_row(k, 1, 150, verify_ms=12 + k) for k in (1, 2, 3, 4)]
    assert batch.ratio_table({"rows": rows}).splitlines()[2] == "| 1 | 1.00 | 1.30 (1.30) | 1.40 (1.40) | " \
                                                               "1.50 (1.50) | 1.60 (1.60) |"
    layouts = {"1 stage": {"rows": [bench_row(0, 1, 100)]}, "2 stages": {"rows": [bench_row(0, 1, 90)]}}
    assert pipeline.layout_table(layouts).splitlines() == ["| k | batch | 1 stage | 2 stages |", "|---|---|---|---|",
                                                           "| 0 | 1 | 100 (1.00) | 90 (0.90) |"]
    profile = {"model": "m", "k": 2, "batch": 1, "kernels_per_step": 300, "kernel_us_per_step": 500,
               "mean_us_per_kernel": 1.67, "busy_us_per_step": 500, "wall_us_per_step": 1000}
    assert scale.profile_table([profile]).endswith("| m | 2 | 1 | 300 | 500 | 1.67 | 500 | 1000 | 50% |")
    assert scale.busy_time([(5, 6), (0, 2), (1, 3), (2.5, 2.7)]) == pytest.approx(4.0)  # [0, 3] and [5, 6]


def test_ab_summary_from_bench_json():
    old = ab.mean_rows([{"rows": [bench_row(0, 1, 100), bench_row(2, 1, 150)]},
                        {"rows": [bench_row(0, 1, 110), bench_row(2, 1, 160)]}])
    new = ab.mean_rows([{"rows": [bench_row(0, 1, 120), bench_row(2, 1, 200)]}])
    assert old[(2, 1)] == (155, 2.0)
    assert ab.ab_table(old, new).splitlines()[2:] == ["| 0 | 1 | 105 | 120 | 1.14 | - | - |",
                                                      "| 2 | 1 | 155 | 200 | 1.29 | 0.74 | 0.83 |"]


def test_step_bytes_counts_weights_and_per_request_states(models):
    from ortspec.manifest import Manifest

    manifest = Manifest.load(models.converted("base"))
    one, two = (scale.step_bytes(manifest, "decode", b, 1, windows=False) for b in (1, 2))
    weights = sum(manifest.weights[n]["length"] for n in manifest.graphs["decode"]["weights"])
    assert one - weights == two - one > 0  # states: the same bytes again per request
    assert scale.step_bytes(manifest, "verify_select_k3", 1, 4, windows=True) > one


def test_host_profile_runs_on_the_cpu(models, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert gpu.main(["profile", str(models.converted("base")), "--provider", "cpu", "-k", "0,2", "--steps", "2",
                     "--top", "3", "--json", str(out)]) == 0
    assert "### k=2, batch 1" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result) == {"k=0", "k=2"} and len(result["k=2"]["top"]) == 3


def test_pack_splits_the_checkpoint_into_parts_that_reassemble(tmp_path, monkeypatch):
    checkpoint, results = tmp_path / "trained", tmp_path / "results"
    checkpoint.mkdir(), results.mkdir()
    weights = np.random.default_rng(0).bytes(20_000)  # incompressible: several parts
    (checkpoint / "model.safetensors").write_bytes(weights)
    monkeypatch.setattr(trained, "PART_BYTES", 4096)
    trained.pack(checkpoint, results)
    parts = sorted(results.glob("trained.tgz.part*"))
    assert len(parts) > 1 and parts[0].name == "trained.tgz.part00"
    joined = tmp_path / "joined.tgz"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        assert tar.extractfile("trained/model.safetensors").read() == weights


EXACT_CPU = ["exact", "--provider", "cpu", "--checkpoint", str(common.TINY), "--dtypes", "float32", "--prompts", "3",
             "--new-tokens", "8", "--batches", "1,2", "--ks", "2", "--exact-batch-size", "2"]


def test_exact_tool_runs_on_the_cpu(tmp_path, capsys):
    """Every configuration of both modes against greedy at batch 1: nothing differs on the CPU; the
    cost rows pair the modes; the table comes last."""
    out = tmp_path / "exact.json"
    assert gpu.main(EXACT_CPU + ["--out", str(tmp_path / "models"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1].startswith("| float32 | default | 2 | readvance | batcher 2 | 3 | 0 |")
    result = json.loads(out.read_text())
    runs = {(r["mode"], r["k"], r["commit"], r["batch"]): r for r in result["runs"]}
    assert len(runs) == 2 * (2 + 2 * 3) and all(r["requests"] == 3 and r["differ"] == 0 for r in runs.values())
    assert result["exact_failures"] == 0 and result["stopped"] is None and result["exact_vs_default_greedy"] == {
        "float32": 0}
    assert [(c["batch"], c["run"]) for c in result["cost"]] == [(1, "greedy"), (1, "best k")]


def test_exact_tool_counts_differing_requests_and_stops_on_budget(tmp_path, capsys, monkeypatch):
    """A planted difference (exact mode's calls of 2 prompts change a token) fails the run: greedy
    and k=2 at batch 2, one request each. A budget spent at once stops the runs cleanly."""
    original = ortspec.Session.generate

    def planted(self, prompt, max_new_tokens=32, **options):
        out = original(self, prompt, max_new_tokens=max_new_tokens, **options)
        if self.exact and max_new_tokens == 8 and len(out) == 2 and isinstance(out[0], list):  # not the warm-up
            return [out[0], out[1][:-1] + [out[1][-1] + 1]]
        return out

    models = ["--out", str(tmp_path / "models"), "--commits", "select"]
    with monkeypatch.context() as patch:
        patch.setattr(ortspec.Session, "generate", planted)
        assert gpu.main(EXACT_CPU + models) == 1
    assert "exact mode: 2 failures" in capsys.readouterr().out
    out = tmp_path / "budget.json"
    assert gpu.main(EXACT_CPU + models + ["--budget-s", "0.001", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["stopped"] == "budget" and all(r["requests"] == 0 for r in result["runs"])


def test_held_out_prompts_are_deterministic_distinct_and_not_benchmark_prompts():
    texts = exact_prompts.held_out_texts(300)
    assert texts == exact_prompts.held_out_texts(300) and len(set(texts)) == 300
    bench = exact_prompts.bench_prompt_texts()
    assert not any(b in t or t in b for b in bench for t in texts)


def test_exact_tool_names_slots_at_another_shape():
    class FakeSession:
        exact = ortspec.runtime.forward_shapes.ExactShape(16, 4)
        stats = {"graphs": {"verify_select_k4/M5/B16/engine0": {}, "mtp_propose_k2/M5/B16/engine0": {},
                            "decode/M1/B16/engine0": {}, "verify_select_k4/M5/B4/engine1": {}}}

    assert exact.shape_violations(FakeSession()) == ["decode/M1/B16/engine0", "verify_select_k4/M5/B4/engine1"]


def agree_cpu(model, tmp_path, *extra) -> tuple[int, dict]:
    """tools/gpu.py agree on a tiny model on the CPU: 4 prompts x 24 tokens, batch 1 and 2, k = 2, one round."""
    out = tmp_path / "agree.json"
    status = gpu.main(["agree", "--model", str(model), "--provider", "cpu", "--prompts", "4", "--new-tokens", "24",
                       "--batches", "1,2", "--ks", "2", "--rounds", "1", "--json", str(out), *extra])
    return status, json.loads(out.read_text())


def test_agree_tool_scripts_the_acceptance_and_keeps_greedy_tokens(models, tmp_path, capsys):
    """Drafts right with p = 0.8: every output equals greedy, and tokens per step is near the
    script's (1 - p^3) / (1 - p) = 2.44 (a step's tokens have sd 0.80; ~40 row-steps per batch
    size make the mean's sd ~0.13, so 0.6 is a 4-sigma bound that p = 0's 1.0 is far outside)."""
    status, result = agree_cpu(models.converted("base"), tmp_path)
    assert status == 0 and result["refused"] == {}
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("| 2 | 2 | ")
    rows = {(r["k"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(0, 1), (2, 1), (0, 2), (2, 2)}
    assert all(r["requests"] == 4 and r["differ"] == 0 and r["rounds"] == 1 for r in rows.values())
    for b in (1, 2):
        spec = rows[(2, b)]
        assert spec["expected_tokens_per_step"] == pytest.approx(2.44)
        assert abs(spec["tokens_per_step"] - 2.44) < 0.6 and spec["row_steps"] >= 30
        assert spec["efficiency"] == pytest.approx(spec["speedup"] / spec["tokens_per_step"])
        assert spec["step_ms"]["verify"] > 0 and rows[(0, b)]["step_ms"]["decode"] > 0


def test_agree_tool_fails_when_the_drafts_are_not_the_scripted_ones(models, tmp_path, monkeypatch):
    """Planted: the MTP head's own drafts (random weights: almost never right) in place of the
    script. The outputs still equal greedy, so the acceptance check must catch it. With p = 0 the
    script itself gives exactly 1 token per step, and passes."""
    from ortspec.speculative.drafts import MTPDrafts

    model = models.converted("base")
    status, result = agree_cpu(model, tmp_path, "--p", "0")
    assert status == 0 and [r["tokens_per_step"] for r in result["rows"] if r["k"] == 2] == [1.0, 1.0]
    monkeypatch.setattr(agree, "scripted_drafts", lambda truths, vocab_size, p, seed: MTPDrafts)
    status, result = agree_cpu(model, tmp_path)
    assert status == 1 and all(r["differ"] == 0 for r in result["rows"])
    assert all(abs(r["z"]) > agree.MAX_Z for r in result["rows"] if r["k"] == 2)


def test_agree_tool_stops_on_its_budget_and_reports_a_refused_k(models, tmp_path, capsys):
    status, result = agree_cpu(models.converted("base"), tmp_path, "--budget-s", "0.001", "--ks", "2,auto")
    assert status == 0 and all(r["rounds"] == 0 and r["tokens_per_second"] is None for r in result["rows"])
    assert "stopped after 0 rounds" in capsys.readouterr().out
    auto_rows = [r for r in result["rows"] if r["k"] == "auto"]  # a row once Session takes "auto"
    assert ("auto" in result["refused"]) != bool(auto_rows)


def test_agree_expected_tokens_per_step_and_its_spread():
    assert agree.expected_tokens_per_step(0.8, 4) == pytest.approx((1 - 0.8**5) / (1 - 0.8))
    assert agree.expected_tokens_per_step(0.0, 3) == 1.0 and agree.expected_tokens_per_step(1.0, 3) == 4.0
    assert agree.tokens_per_step_sd(0.5, 1) == pytest.approx(0.5)  # 1 or 2 tokens, even odds
    assert agree.tokens_per_step_sd(0.0, 4) == 0.0 and agree.tokens_per_step_sd(1.0, 4) == 0.0
    assert agree.z_score(1.0, 0.0, 2, 10) == 0.0 and agree.z_score(1.5, 0.0, 2, 10) == float("inf")
    assert agree.z_score(1.5, 0.5, 1, 100) == pytest.approx(0.0) and agree.z_score(1.6, 0.5, 1, 100) == \
        pytest.approx(2.0)


def test_auto_loop_tool_runs_on_the_cpu(models, capsys):
    """auto_loop's checks and timing with the pipelined loop forced onto the CPU (fixed rows)."""
    from tools.gpu_suite import auto_loop

    model, checks = models.converted("base"), common.Checks()
    prompts = common.SHORT_PROMPTS * 6  # 18: batch 16 is a prefix
    loop = {"pipelined": True, "fixed_rows": True}
    auto_loop.identity(model, "base", prompts, 24, checks, provider="cpu", loop_options=loop)
    auto_loop.states(model, "base", prompts, 24, checks, provider="cpu")
    rows = auto_loop.speed(model, "base", prompts, 1, 1, checks, provider="cpu", new_tokens=6, loop_options=loop)
    assert checks.failures == 0 and len(checks.results) == 9 + 4 + 3, checks.results
    assert [row[1] for row in rows] == [1, 4, 16] and all(row[-1] == 0 for row in rows)  # float32: auto == greedy
    assert "auto == greedy: True" in capsys.readouterr().out


GDN_VERIFY_CPU = ["gdn_verify", "--provider", "cpu", "--forms", "per_row,transition", "--check-models", "tiny",
                  "--time-models", "tiny", "--time-dtype", "float32", "--ks", "1,2", "--batches", "1,2", "--steps", "2",
                  "--rounds", "1", "--new-tokens", "8"]


def test_gdn_verify_tool_runs_on_the_cpu(tmp_path, capsys):
    """The forms' checks and timings with the portable graphs on the CPU (state_window is CUDA
    only, so not asked for): every check passes, one timing row per (form, batch), the table last."""
    out = tmp_path / "gdn.json"
    assert gpu.main(GDN_VERIFY_CPU + ["--out", str(tmp_path / "models"), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-6] == "| form | batch | decode ms | k=1 | k=2 |" and lines[-1].startswith("| transition | 2 | ")
    result = json.loads(out.read_text())
    checks = {name: value for name, value in result.items() if name != "timings"}
    assert len(checks) == 2 * (2 * 2 + 2) and all(v is True or (isinstance(v, int) and v > 0) for v in checks.values())
    rows = result["timings"][0]["rows"]
    assert [(r["form"], r["batch"]) for r in rows] == [("per_row", 1), ("per_row", 2), ("transition", 1), ("transition", 2)]
    assert all(r["decode_ms"] > 0 and set(r["verify_ms"]) == {"1", "2"} for r in rows)


def test_gdn_verify_tool_fails_when_the_replay_drops_a_row(tmp_path, monkeypatch, capsys):
    """Planted: the transition commit replays one row too few; the state check must fail the run."""
    from ortspec.runtime.arrays import HostArrays

    replay = HostArrays.replay_transitions
    monkeypatch.setattr(HostArrays, "replay_transitions", lambda self, states, *record_and_counts: replay(
        self, states, *record_and_counts[:4], np.maximum(np.asarray(record_and_counts[4]) - 1, 0)))
    args = GDN_VERIFY_CPU + ["--forms", "transition", "--time-models", "", "--out", str(tmp_path)]
    assert gpu.main(args) == 1
    assert "STATE CHECK FAILED" in capsys.readouterr().out


def test_gdn_verify_ratio_table():
    rows = [{"form": "per_row", "batch": 1, "decode_ms": 1.25, "verify_ms": {1: 2.5, 3: 3.0}},
            {"form": "transition", "batch": 16, "decode_ms": 2.0, "verify_ms": {1: 2.2, 3: 2.9}}]
    assert gdn_verify.ratio_table(rows, [1, 3]).splitlines()[2:] == ["| per_row | 1 | 1.250 | 2.00 | 2.40 |",
                                                                     "| transition | 16 | 2.000 | 1.10 | 1.45 |"]


def test_gdn_verify_tool_reports_a_failing_form_and_goes_on(tmp_path, monkeypatch, capsys):
    """A form whose graphs fail (as state_window might where ONNX Runtime refuses it) is a reported
    failure; the other form is still checked and timed."""
    from tools.gpu_suite import step_timer

    verify_ms = step_timer.StepTimer.verify_ms

    def refuse_transition(self, k, steps, accepted=None):
        if self.graphs.manifest.gdn_verify == "transition":
            raise RuntimeError("planted: ONNX Runtime refused the graph")
        return verify_ms(self, k, steps, accepted)

    monkeypatch.setattr(step_timer.StepTimer, "verify_ms", refuse_transition)
    out = tmp_path / "gdn.json"
    args = GDN_VERIFY_CPU + ["--check-models", "", "--ks", "1", "--out", str(tmp_path), "--json", str(out)]
    assert gpu.main(args) == 1
    assert "FAILED timing transition batch 1: RuntimeError: planted" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["form"], r["batch"]) for r in result["timings"][0]["rows"]] == [("per_row", 1), ("per_row", 2)]
    assert result["timing transition batch 1: ran"] is False


def test_gdn_verify_kernel_check_on_host_buffers(monkeypatch):
    """kernel_check's logic at small shapes with CPU buffers: the replay agrees with itself, timings come back."""
    monkeypatch.setattr(gdn_verify, "KERNEL_SHAPES", {"small": (2, 4, 3, 8)})
    monkeypatch.setattr(gdn_verify, "CONV_TAIL", (3, 16))
    checks = common.Checks()
    results = gdn_verify.kernel_check(checks, device_name="cpu")
    assert checks.failures == 0 and len(checks.results) == 2
    assert set(results) == {"small replay us, batch 1, 3 layers", "small replay us, batch 16, 3 layers"}
