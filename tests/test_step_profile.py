"""tools/step_profile.py: a generate call's prefill groups and steps, each split into Runs and host work."""

from __future__ import annotations

from ortspec.runtime.graphs import GraphRunner
from ortspec.speculative.decoder import Decoder
from tools.step_profile import main, profile_calls


def test_rows_split_each_step_into_runs_and_host_work(models):
    originals = Decoder._prefill_forward, Decoder._prefill_finish, Decoder.step, GraphRunner.run
    rows, wall = profile_calls(str(models.converted("base")), 2, 3, 1, 2, None, 12)
    by_what = {r["what"]: r for r in rows}
    assert any(w.startswith("prefill, 1 x ") for w in by_what)  # the bench's prompts differ in length
    steps = [r for w, r in by_what.items() if w.startswith("step, k=2, ")]
    assert steps and all(0 < r["run_ms"] <= r["ms"] and r["host_ms"] >= 0 for r in steps)
    assert sum(r["ms_per_call"] for r in rows) <= 1e3 * wall * 1.05
    assert (Decoder._prefill_forward, Decoder._prefill_finish, Decoder.step, GraphRunner.run) == originals  # the clock is taken off


def test_main_prints_a_table_per_k(models, capsys):
    assert main([str(models.converted("base")), "-k", "0,1", "--batch", "2", "--calls", "1", "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "### k=0, batch 2" in out and "### k=1, batch 2" in out and "| step, k=1, 2 of 2 rows |" in out
