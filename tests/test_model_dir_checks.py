"""What a load and ``ortspec verify`` check in a converted model directory, and the typed
errors a damaged one gets (never a raw JSONDecodeError, KeyError, ValueError or protobuf error)."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

import ortspec
from ortspec.cli import main
from ortspec.converter import staging
from ortspec.manifest import Manifest
from tests.small_models import convert_small
from tools.make_tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    make_checkpoint(root / "ck", seed=41)
    return convert_small(root / "ck", root / "model")


@pytest.fixture
def model(converted, tmp_path):
    """A private copy to damage."""
    return shutil.copytree(converted, tmp_path / "model")


def load(model_dir):
    return ortspec.Session(model_dir, num_speculative_tokens=1)


def test_manifest_records_every_file(converted):
    manifest = Manifest.load(converted)
    assert sorted(manifest.files) == sorted(set(os.listdir(converted)) - {"manifest.json"})
    for name, record in manifest.files.items():
        assert len(record["sha256"]) == 64 and record["size"] == (converted / name).stat().st_size
    assert ortspec.verify(converted) == {n: r["size"] for n, r in manifest.files.items()}


@pytest.mark.parametrize("change", ["extra", "truncated", "empty"])
def test_weights_of_another_size_are_refused_at_load(model, change):
    path = model / "weights.bin"
    data = path.read_bytes()
    path.write_bytes({"extra": data + b"\0" * 8, "truncated": data[: len(data) // 2], "empty": b""}[change])
    with pytest.raises(ortspec.ModelDirError, match=rf"weights\.bin is {path.stat().st_size} bytes but manifest.json "
                                                    rf"records {len(data)}"):
        load(model)


def test_a_truncated_graph_is_refused_at_load(model):
    path = model / "decode.onnx"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ortspec.ModelDirError, match=r"decode\.onnx is 100 bytes"):
        load(model)


def test_a_same_size_corrupt_graph_is_a_typed_error_and_found_by_verify(model):
    name = Manifest.load(model).graph_entry("decode", "cpu")["file"]  # the graph a CPU session loads
    assert name == "decode.cpu.onnx"
    path = model / name
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))
    with pytest.raises(ortspec.ModelDirError, match=r"cannot load graph decode\.cpu\.onnx.*ortspec verify"):
        load(model)
    with pytest.raises(ortspec.ModelDirError, match=r"decode\.cpu\.onnx does not match its sha256"):
        ortspec.verify(model)


def test_half_of_lm_head_overwritten_loads_but_verify_finds_it(model, capsys):
    manifest = Manifest.load(model)
    entry = manifest.weights["lm_head"]
    with open(model / "weights.bin", "r+b") as f:
        f.seek(entry["offset"])
        f.write(bytes(entry["length"] // 2))
    load(model)  # sizes agree: a load cannot know without reading every byte
    with pytest.raises(ortspec.ModelDirError, match=r"weights\.bin does not match its sha256 checksum"):
        ortspec.verify(model)
    assert main(["verify", str(model)]) == 2
    assert "weights.bin does not match" in capsys.readouterr().err


def test_cli_verify_passes_an_intact_model(converted, capsys):
    assert main(["verify", str(converted)]) == 0
    assert "every size and sha256 matches" in capsys.readouterr().out


@pytest.mark.parametrize("damage,match", [
    (lambda text: text[: len(text) // 2], "is not valid JSON"),
    (lambda text: np.random.default_rng(1).bytes(len(text)), "is not valid JSON"),
    (lambda text: "[1, 2]", "holds a JSON list"),
    (lambda text: _edit(text, lambda d: d.pop("graphs")), "lacks 'graphs'"),
    (lambda text: _edit(text, lambda d: d.pop("files")), "lacks 'files'"),
    (lambda text: _edit(text, lambda d: d["weights"].update(tensors=[])), "'weights.tensors' of type list"),
    (lambda text: _edit(text, lambda d: d["graphs"].update(decode="decode.onnx")), "invalid entry for graph 'decode'"),
    (lambda text: _edit(text, lambda d: d["graphs"]["decode"].update(cpu="decode.cpu.onnx")),
     "invalid entry for graph 'decode'"),
    (lambda text: _edit(text, lambda d: d["files"].pop("decode.cpu.onnx")), "records no size for 'decode.cpu.onnx'"),
    (lambda text: _edit(text, lambda d: d["files"].pop("weights.bin")), "records no size for 'weights.bin'"),
    (lambda text: _edit(text, lambda d: d["files"]["weights.bin"].update(size="12")), "invalid file record"),
    (lambda text: _edit(text, lambda d: d["model"].update(hidden_size=None, colour=1)), "invalid 'model' section"),
    (lambda text: _edit(text, lambda d: d.update(format="ortspec/1")),
     "records no file sizes or checksums.*reconvert it: ortspec convert .* --overwrite"),
])
def test_a_damaged_manifest_is_a_typed_error(model, damage, match):
    path = model / "manifest.json"
    data = damage(path.read_text())
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(ortspec.ModelDirError, match=match):
        load(model)
    with pytest.raises(ortspec.ModelDirError):
        ortspec.verify(model)


def test_a_model_with_a_cut_short_manifest_is_reconverted_as_its_error_says(model):
    path = model / "manifest.json"
    source = Manifest.load(model).source["checkpoint"]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ortspec.ModelDirError, match="reconvert it: ortspec convert CHECKPOINT_DIR .* --overwrite"):
        load(model)
    convert_small(source, model, overwrite=True)
    ortspec.verify(model)


def _edit(text: str, change) -> str:
    doc = json.loads(text)
    change(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("name", ["mtp_propose_k1.onnx", "mtp_propose_k1.cpu.onnx"])
def test_a_missing_file_is_named(model, name):
    (model / name).unlink()
    with pytest.raises(ortspec.ModelDirError, match=f"missing {re.escape(name)}"):
        load(model)


def test_planted_bug_a_writer_that_hashes_less_than_it_writes_is_caught_by_verify(converted, tmp_path, monkeypatch):
    """If the converter's checksums ever stopped covering every byte written (here: the zero
    padding between weights), verify must report the file instead of passing it."""
    write = staging.RecordingFile.write

    def skip_padding(self, data):
        view = memoryview(data).cast("B")
        if view.nbytes and not any(view):  # written and counted, but not hashed
            self._file.write(view)
            self.size += view.nbytes
            return view.nbytes
        return write(self, data)

    monkeypatch.setattr(staging.RecordingFile, "write", skip_padding)
    out = convert_small(Manifest.load(converted).source["checkpoint"], tmp_path / "m")
    monkeypatch.undo()
    with pytest.raises(ortspec.ModelDirError, match=r"weights\.bin does not match"):
        ortspec.verify(out)
