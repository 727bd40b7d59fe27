"""tools/cpu_op_profile.py: wall and op tables for every graph kind, including the MTP propose graph."""

from __future__ import annotations

from tools.cpu_op_profile import main


def test_profile_tables_cover_target_and_mtp_graphs(models, capsys):
    graphs = "decode,verify_select_k2,mtp_propose_k2"
    assert main([str(models.converted("base")), "--graphs", graphs, "--runs", "2", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    for name in graphs.split(","):
        assert f"| {name} |" in out  # wall table row
        assert f"{name} us (nodes)" in out  # op table column
    assert "| LinearAttention |" in out and "| all |" in out
