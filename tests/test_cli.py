"""The command line a newcomer meets first: every --help, one spelling of k, the bench's
outputs checked before it runs, generate's labelled accept lengths."""

from __future__ import annotations

import argparse
import json
import re
import sys

import pytest

from ortspec.cli import build_parser, main


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def help_text(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command_without_markup(capsys):
    text = help_text([], capsys)
    for command in subcommands(build_parser()):
        assert re.search(rf"^\s+{command}\s+\S", text, re.M), f"{command} missing from ortspec --help"
    assert "``" not in text and ":class:" not in text


def help_entries(text: str) -> dict[str, str]:
    """{first word of an entry ('-k', '--dtype', 'model'): its help text, lines joined}."""
    entries, current = {}, None
    for line in text.split("options:", 1)[0].splitlines() + text.split("options:", 1)[1].splitlines():
        if re.match(r"^  \S", line):  # an entry starts at indent 2; its wrapped help is indented further
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
    return {name: " ".join(entry.split()) for name, entry in entries.items()}


@pytest.mark.parametrize("command", sorted(subcommands(build_parser())))
def test_every_option_shows_its_help_and_default(command, capsys):
    entries = help_entries(help_text([command], capsys))
    for action in subcommands(build_parser())[command]._actions:
        if action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and name in entries, f"{command} {name} is not listed with a help text"
        assert "``" not in entries[name]
        if action.option_strings and action.default is not None and action.default is not False:
            assert "default: " in entries[name], f"{command} {name} shows no default: {entries[name]!r}"


def test_k_has_one_spelling_and_the_old_ones_still_work(capsys):
    parser = build_parser()
    assert parser.parse_args(["convert", "ck", "out", "-k", "2"]).k == 2
    assert parser.parse_args(["convert", "ck", "out", "-K", "3"]).k == 3  # earlier spelling, hidden
    assert parser.parse_args(["generate", "m", "--prompt", "x", "--num-speculative-tokens", "2"]).k == 2
    assert parser.parse_args(["bench", "m", "-k", "0,2"]).k == [0, 2]
    assert parser.parse_args(["bench", "m", "--k", "0,3"]).k == [0, 3]  # earlier spelling, hidden
    assert parser.parse_args(["bench", "m"]).k == [0, 1, 2, 3, 4]
    for command in ("convert", "generate", "bench"):
        text = help_text([command], capsys)
        assert "-k " in text and "--num-speculative-tokens" in text
        assert not re.search(r"(^|\s)(-K|--k)\b", text), f"{command} --help shows an old spelling"


def test_convert_help_names_no_option_it_lacks(capsys):
    text = help_text(["convert"], capsys)
    own = {s for a in subcommands(build_parser())["convert"]._actions for s in a.option_strings}
    assert set(re.findall(r"--[a-z][a-z-]+", text)) <= own


def test_plot_without_matplotlib_fails_before_benchmarking(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("ortspec.bench.run_bench", lambda *a, **k: pytest.fail("benchmarked before failing"))
    code = main(["bench", str(models.converted("base")), "--plot", str(tmp_path / "b.png")])
    assert code == 2
    assert "pip install 'ortspec[bench]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_json_into_a_missing_directory_fails_before_benchmarking(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("ortspec.bench.run_bench", lambda *a, **k: pytest.fail("benchmarked before failing"))
    code = main(["bench", str(models.converted("base")), "--json", str(tmp_path / "no" / "b.json")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_generate_labels_accept_lengths(models, capsys):
    code = main(["generate", str(models.converted("base")), "--ids", "--prompt", "5 17 99", "--max-new-tokens", "12",
                 "-k", "2", "--threads", "1"])
    assert code == 0
    err = capsys.readouterr().err
    counts = re.search(r"accept lengths \(length: steps\) 0: (\d+), 1: (\d+), 2: (\d+)\]", err)
    assert counts, err
    assert sum(map(int, counts.groups())) > 0


def test_generate_with_bad_ids_is_a_typed_error(models, capsys):
    code = main(["generate", str(models.converted("base")), "--ids", "--prompt", "3 one 4"])
    assert code == 2 and "--ids expects whitespace- or comma-separated integers" in capsys.readouterr().err


def test_generate_exact_gives_the_default_tokens(models, capsys):
    argv = ["generate", str(models.converted("base")), "--ids", "--prompt", "5 17 99", "--max-new-tokens", "10",
            "-k", "2", "--threads", "1"]
    assert main(argv) == 0
    default = capsys.readouterr().out
    assert main(argv + ["--exact", "--exact-batch-size", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == default and "exact mode: every forward 2 x 5 tokens" in out.err


def test_generate_and_bench_take_k_auto(models, tmp_path, capsys):
    out = str(models.converted("base"))
    argv = ["generate", out, "--ids", "--prompt", "5 17 99", "--max-new-tokens", "10", "--threads", "1"]
    assert main(argv) == 0
    greedy = capsys.readouterr().out
    assert main(argv + ["-k", "auto"]) == 0
    result = capsys.readouterr()
    assert result.out == greedy and "auto k (up to 4): steps by k" in result.err
    with pytest.raises(SystemExit):
        main(argv + ["-k", "often"])
    assert 'expected an integer or "auto"' in capsys.readouterr().err
    assert main(["bench", out, "-k", "0,auto", "--max-new-tokens", "6", "--repeats", "1", "--threads", "1",
                 "--json", str(tmp_path / "b.json")]) == 0
    assert "| auto (steps by k: " in capsys.readouterr().out
    rows = {r["k"]: r for r in json.loads((tmp_path / "b.json").read_text())["rows"]}
    assert set(rows) == {0, "auto"} and sum(rows["auto"]["steps_by_k"]) == rows["auto"]["steps"]
