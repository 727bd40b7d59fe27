"""Packaging: every folder of the package is a package (a wheel built by setuptools'
find_packages leaves out folders without __init__.py, and a non-editable install would then
fail to import them); setup.py compiles CUDA only where asked or where a GPU is, and reuses
what it built before (its build cache), tested function by function without a build."""

import importlib.util
import os
import stat
import time
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ortspec"
ROOT = PACKAGE.parent


def test_every_source_folder_has_an_init():
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    assert folders, "no sources found"
    assert sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists()) == []


# ---- setup.py: when CUDA is compiled, and the build cache --------------------------------


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module: imported under another name than __main__, it runs no build (and
    needs neither pybind11 nor setuptools)."""
    spec = importlib.util.spec_from_file_location("ortspec_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def no_probe():
    raise AssertionError("the GPU probe ran although a variable decided")


@pytest.mark.parametrize("environ, build, required", [
    ({"ORTSPEC_NO_CUDA": "1"}, False, False),
    ({"ORTSPEC_CUDA": "0"}, False, False),
    ({"ORTSPEC_CUDA": "1"}, True, True),
    ({"ORTSPEC_CUDA": "1", "ORTSPEC_NO_CUDA": "1"}, False, False),  # off wins
])
def test_variables_decide_cuda_without_probing(setup_py, environ, build, required):
    decision = setup_py.cuda_decision(environ, no_probe)
    assert (decision.build, decision.required) == (build, required)


@pytest.mark.parametrize("gpu", [True, False])
def test_by_default_cuda_is_compiled_only_where_a_gpu_is(setup_py, gpu):
    for environ in ({}, {"ORTSPEC_NO_CUDA": "0"}, {"ORTSPEC_CUDA": ""}):
        decision = setup_py.cuda_decision(environ, lambda: gpu)
        assert (decision.build, decision.required) == (gpu, False)
    if not gpu:
        assert "ORTSPEC_CUDA=1" in decision.reason  # says how to ask for it


@pytest.mark.parametrize("name", ["ORTSPEC_CUDA", "ORTSPEC_NO_CUDA"])
def test_an_unclear_switch_stops_the_build(setup_py, name):
    with pytest.raises(SystemExit, match=name):
        setup_py.cuda_decision({name: "yes"}, no_probe)


def fake_nvidia_smi(directory, output: str, status: int):
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '{output}'\nexit {status}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.skipif(os.name != "posix", reason="the fake nvidia-smi is a shell script")
def test_the_gpu_probe_reads_nvidia_smi(setup_py, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    fake_nvidia_smi(tmp_path, "GPU 0: NVIDIA H200 (UUID: GPU-0)", 0)
    assert setup_py.nvidia_gpu_present()
    fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.", 9)
    assert setup_py.nvidia_gpu_present() == os.path.exists("/proc/driver/nvidia")


def test_object_keys_follow_source_flags_and_headers_not_temporary_paths(setup_py, tmp_path):
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }\n")
    command = ["c++", "-O3", "-DX=1", "-I/tmp/pip-build-env-1/overlay/pybind11/include", "-c", str(source)]
    key = setup_py.object_key(command, source, "context")
    other_env = [arg.replace("pip-build-env-1", "pip-build-env-2") for arg in command]
    assert setup_py.object_key(other_env, source, "context") == key
    assert setup_py.object_key([*command, "-DORTSPEC_WITH_CUDA"], source, "context") != key
    assert setup_py.object_key(command, source, "other headers") != key
    source.write_text("int f() { return 2; }\n")
    assert setup_py.object_key(command, source, "context") != key


def test_the_build_context_changes_with_a_header(setup_py, tmp_path, monkeypatch):
    header = tmp_path / "csrc" / "h.h"
    header.parent.mkdir()
    header.write_text("#define A 1\n")
    monkeypatch.setattr(setup_py, "ROOT", tmp_path)
    monkeypatch.setattr(setup_py, "HEADERS", ["csrc/h.h"])
    before = setup_py.build_context("3.1.0")
    header.write_text("#define A 2\n")
    assert setup_py.build_context("3.1.0") != before
    assert setup_py.build_context("3.0.0") != setup_py.build_context("3.1.0")


def test_a_cached_build_runs_once_and_then_copies(setup_py, tmp_path):
    cache, built, outcomes = setup_py.BuildCache(tmp_path / "cache"), [], []

    def build_into(path):
        def build():
            built.append(path)
            path.write_bytes(b"object code")
        return build

    first, second = tmp_path / "t1" / "a.o", tmp_path / "t2" / "a.o"  # two fresh build directories
    first.parent.mkdir()
    setup_py.cached_build(cache, "k", ".o", str(first), build_into(first), outcomes)
    setup_py.cached_build(cache, "k", ".o", str(second), build_into(second), outcomes)
    assert built == [first] and outcomes == [False, True]
    assert second.read_bytes() == b"object code"
    setup_py.cached_build(cache, "other", ".o", str(second), build_into(second), outcomes)
    assert built == [first, second]  # another key builds


def test_prune_deletes_only_entries_unused_for_long(setup_py, tmp_path):
    cache = setup_py.BuildCache(tmp_path)
    (tmp_path / "old").write_bytes(b"x")
    (tmp_path / "new").write_bytes(b"x")
    month_ago = time.time() - 30 * 86400
    os.utime(tmp_path / "old", (month_ago, month_ago))
    cache.prune(setup_py.CACHE_DAYS * 86400)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]
