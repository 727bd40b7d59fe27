"""Crash-safe conversion: an output directory is replaced whole or not at all, only when it is
an ortspec model and overwrite=True, and a killed conversion leaves the old model working."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ortspec
from ortspec.converter import rename
from ortspec.manifest import Manifest
from tests.small_models import convert_small as convert
from tools.make_tiny_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 1, 4, 1, 5]


def tokens(model_dir) -> list[int]:
    return ortspec.Session(model_dir, num_speculative_tokens=1).generate(PROMPT, max_new_tokens=8)


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.ortspec-tmp-*"))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two checkpoints of one config with different weights, A already converted."""
    root = tmp_path_factory.mktemp("safety")
    make_checkpoint(root / "a", seed=31, tokenizer=True)
    make_checkpoint(root / "b", seed=32, tokenizer=True)
    convert(root / "a", root / "model_a")
    return root, tokens(root / "model_a")


def fresh_model(two, tmp_path) -> Path:
    root, _ = two
    return convert(root / "a", tmp_path / "model")


_KILLED_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
import ortspec
from ortspec.converter import staging

write_bytes = staging.StagingDir.write_bytes
def write_then_wait(self, name, data, record=True):  # weights.bin is written; so is one graph: stop here
    write_bytes(self, name, data, record)
    if name.endswith(".onnx"):
        print("written", name, flush=True)
        time.sleep(600)
staging.StagingDir.write_bytes = write_then_wait
ortspec.convert({ck!r}, {out!r}, num_speculative_tokens=1, max_length=32, overwrite=True, progress=False)
"""


def test_sigkill_midway_leaves_the_old_model_working(two, tmp_path):
    """A conversion over an existing model, killed after writing the new weights.bin and a graph:
    the old model still loads, verifies and generates its old tokens; the next conversion cleans up."""
    root, old_tokens = two
    out = fresh_model(two, tmp_path)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD.format(root=str(ROOT), ck=str(root / "b"),
                                                                          out=str(out))],
                             stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 300)
        line = child.stdout.readline() if ready else ""
        assert line.startswith("written"), f"the child never reached its first graph (exit {child.poll()})"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert leftovers(out), "the kill should have left the child's staging directory behind"
    assert tokens(out) == old_tokens
    ortspec.verify(out)
    convert(root / "b", out, overwrite=True)
    assert leftovers(out) == []
    assert tokens(out) != old_tokens
    ortspec.verify(out)


def test_reconverting_with_a_smaller_k_leaves_no_stale_graphs(two, tmp_path):
    root, _ = two
    out = convert(root / "a", tmp_path / "model", num_speculative_tokens=3)
    assert (out / "verify_k3.onnx").is_file()
    convert(root / "a", out, num_speculative_tokens=1, overwrite=True)
    manifest = Manifest.load(out)
    assert sorted(os.listdir(out)) == sorted([*manifest.files, "manifest.json"])
    assert not (out / "verify_k3.onnx").exists() and manifest.num_speculative_tokens == 1
    assert leftovers(out) == []


def test_an_existing_model_needs_overwrite(two, tmp_path):
    root, old_tokens = two
    out = fresh_model(two, tmp_path)
    before = (out / "weights.bin").stat().st_mtime_ns
    with pytest.raises(ortspec.OutputDirError, match="already holds a converted model.*overwrite=True"):
        convert(root / "b", out)
    assert (out / "weights.bin").stat().st_mtime_ns == before and leftovers(out) == []
    assert tokens(out) == old_tokens


@pytest.mark.parametrize("contents", [
    {"notes.txt": "mine"},
    {"manifest.json": json.dumps({"format": "webapp/3"})},
    {"manifest.json": "[1, 2]", "model.onnx": "x"},
])
def test_a_directory_of_other_files_is_never_replaced(two, tmp_path, contents):
    root, _ = two
    out = tmp_path / "mine"
    out.mkdir()
    for name, text in contents.items():
        (out / name).write_text(text)
    with pytest.raises(ortspec.OutputDirError, match="not an ortspec model"):
        convert(root / "a", out, overwrite=True)
    assert {p.name: p.read_text() for p in out.iterdir()} == contents


def test_a_model_directory_with_added_files_is_not_replaced(two, tmp_path):
    root, _ = two
    out = fresh_model(two, tmp_path)
    (out / "README.md").write_text("my notes")
    with pytest.raises(ortspec.OutputDirError, match=r"README\.md"):
        convert(root / "a", out, overwrite=True)
    assert (out / "README.md").read_text() == "my notes"


def test_checkpoint_and_file_outputs_are_refused_before_any_work(two, tmp_path):
    root, _ = two
    ck = tmp_path / "ck"
    make_checkpoint(ck, seed=33)
    before = sorted(os.listdir(ck))
    with pytest.raises(ortspec.OutputDirError, match="is the checkpoint directory"):
        convert(ck, ck, overwrite=True)
    with pytest.raises(ortspec.OutputDirError, match="contains the checkpoint"):
        convert(ck, tmp_path, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ortspec.OutputDirError, match="is a file"):
        convert(ck, tmp_path / "file")
    assert sorted(os.listdir(ck)) == before and leftovers(ck) == [] and leftovers(tmp_path / "file") == []
    assert isinstance(ortspec.OutputDirError("x"), OSError)


def test_an_unwritable_parent_is_a_typed_error(two, tmp_path):
    root, _ = two
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        if os.access(parent, os.W_OK):  # root writes anywhere: use a directory the kernel refuses instead
            parent = Path("/sys")
        with pytest.raises(ortspec.OutputDirError, match="writable"):
            convert(root / "a", parent / "out")
    finally:
        (tmp_path / "locked").chmod(0o700)


def test_an_empty_directory_and_a_symlink_are_converted_into(two, tmp_path):
    root, old_tokens = two
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty").chmod(0o750)
    convert(root / "a", tmp_path / "empty")
    assert tokens(tmp_path / "empty") == old_tokens and (tmp_path / "empty").stat().st_mode & 0o777 == 0o750
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    convert(root / "b", tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").is_symlink() and tokens(tmp_path / "empty") != old_tokens


def test_without_renameat2_the_fallback_still_replaces_whole(two, tmp_path, monkeypatch):
    root, _ = two
    monkeypatch.setattr(rename, "_libc_renameat2", lambda: None)
    out = convert(root / "a", tmp_path / "model", num_speculative_tokens=2)
    convert(root / "a", out, num_speculative_tokens=1, overwrite=True)
    assert not (out / "verify_k2.onnx").exists() and leftovers(out) == []
    ortspec.verify(out)


def test_exchange_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from_a").touch()
    if not rename.exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this platform or filesystem has no renameat2(RENAME_EXCHANGE); the fallback is tested above")
    assert os.listdir(tmp_path / "b") == ["from_a"] and os.listdir(tmp_path / "a") == []
    with pytest.raises(FileExistsError):
        rename.rename_noreplace(tmp_path / "a", tmp_path / "b")


def test_stale_staging_is_removed_only_when_no_conversion_runs(two, tmp_path):
    """Staging directories of dead conversions are removed, but not while another conversion runs
    in the same parent (it holds a shared lock there)."""
    import fcntl

    root, _ = two
    out = fresh_model(two, tmp_path)
    live = tmp_path / ".model.ortspec-tmp-live"
    live.mkdir()
    holder = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)  # as a running conversion into tmp_path holds it
    try:
        with pytest.raises(ortspec.OutputDirError, match="already holds"):
            convert(root / "a", out)
        convert(root / "a", out, overwrite=True)
        assert leftovers(out) == [live.name]
    finally:
        os.close(holder)
    convert(root / "a", out, overwrite=True)
    assert leftovers(out) == []


def test_cli_convert_refuses_an_existing_model_without_overwrite(two, tmp_path, capsys):
    from ortspec.cli import main

    root, _ = two
    out = fresh_model(two, tmp_path)
    args = ["convert", str(root / "b"), str(out), "-K", "1", "--max-length", "32"]
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0
    ortspec.verify(out)
