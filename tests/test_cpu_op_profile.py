"""tools/cpu_op_profile.py: wall and op tables for every graph kind, including the MTP propose
graph, of the variant a CPU Session loads and of the portable one."""

from __future__ import annotations

from tools.cpu_op_profile import main


def test_profile_tables_cover_target_and_mtp_graphs(models, capsys):
    graphs = "decode,verify_select_k2,mtp_propose_k2,verify_select_k2@portable"
    assert main([str(models.converted("base")), "--graphs", graphs, "--runs", "2", "--batch", "2", "--top", "60"]) == 0
    out = capsys.readouterr().out
    for name in graphs.split(","):
        assert f"| {name} |" in out  # wall table row
        assert f"{name} us (nodes)" in out  # op table column
    assert "| all |" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines() if line.startswith("| ")}
    assert rows["LinearAttention"][1] == " - " and rows["LinearAttention"][3] != " - "  # only the portable graph has it
    assert rows["QuickGelu"][1] != " - " and rows["QuickGelu"][3] == " - "
