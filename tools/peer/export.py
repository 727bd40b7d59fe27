"""Export a checkpoint for onnxruntime-genai: its own model builder, then the directories its
runtime loads (the MTP head as a model of its own, the CUDA-graph variants, a CPU variant).

    <work>/relaid/             the checkpoint re-laid for the builder (relayout.py)
    <work>/peer/               builder output: model.onnx(.data), mtp.onnx(.data), genai_config.json
    <work>/peer_head/          mtp.onnx, mtp.onnx.data, model.onnx.data (hard links; the head reads
                               the shared embedding and lm_head from the main model's data file) and
                               a genai_config.json whose decoder is the main config's "mtp" section
    <work>/peer_graph/         model files linked, genai_config.json with enable_cuda_graph "1"
    <work>/peer_head_graph/    the same for the head
    <work>/peer_cpu/, peer_head_cpu/   CPU variants (--provider cpu): no provider options and no
                               "shared_initializers" (the peer's CPU runtime refuses them with
                               "GetMemoryInfo for CPU should not be used"; the initializers are
                               still in the ONNX files as external data, so nothing is lost), and
                               the intra-op threads asked for

On the CPU the builder exports fp32 for its CPU EP (-p fp32 -e cpu: the fused CPU kernels
LinearAttention, CausalConvWithState, GatedRMSNorm, GroupQueryAttention), the export a CPU user
of the peer runs; fp16 exports are made for the CUDA EP (-e cuda), on a CPU machine too.

genai parses genai_config.json strictly (an unknown key fails), which is why the head's decoder
section is built from a list of the keys its decoder element accepts, not copied whole.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ortspec.errors import OrtspecError

from .relayout import relay_checkpoint

BUILDER_MODULE = "onnxruntime_genai.models.builder"
HEAD_FILES = ("mtp.onnx", "mtp.onnx.data", "model.onnx.data")
MAIN_FILES = ("model.onnx", "model.onnx.data")
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json")
# Keys of genai's decoder element (src/config.cpp, Decoder_Element) the head's section may carry.
DECODER_KEYS = ("filename", "session_options", "run_options", "head_size", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "inputs", "outputs", "shared_initializers")


class PeerExportError(OrtspecError, RuntimeError):
    """onnxruntime-genai's builder failed or wrote an unexpected directory."""


@dataclass(frozen=True)
class PeerDirs:
    """The model directories the peer's runtime loads; graph ones are None on the CPU."""

    main: Path
    head: Path | None
    graph_main: Path | None = None
    graph_head: Path | None = None


def builder_command(checkpoint: Path, out: Path, cache: Path, precision: str = "fp16") -> list[str]:
    """The builder run docs/benchmarks.md records: fp16 for the CUDA EP (it runs on a CPU machine too);
    fp32 for its CPU EP."""
    execution = "cpu" if precision == "fp32" else "cuda"
    return [sys.executable, "-m", BUILDER_MODULE, "-i", str(checkpoint), "-o", str(out), "-p", precision,
            "-e", execution, "-c", str(cache)]


def run_builder(relaid: Path, out: Path, log: Path, precision: str = "fp16") -> Path:
    """Runs the builder into out.partial and renames it to out when its outputs are all there,
    so an interrupted export never looks finished. Raises PeerExportError with the log's tail."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cmd = builder_command(relaid, partial, out.parent / "builder_cache", precision)
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # a local checkpoint: no hub
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out.parent, env=offline)
    tail = log.read_text()[-2000:]
    if done.returncode:
        hint = (" (onnxruntime_genai is not importable: pip install onnxruntime-genai==0.18.0 onnx-ir, or put the "
                "staged wheels on PYTHONPATH)") if "No module named" in tail else ""
        raise PeerExportError(f"onnxruntime-genai's builder failed (exit {done.returncode}){hint}: "
                              f"{' '.join(cmd)}\n{tail}")
    missing = [n for n in ("model.onnx", "genai_config.json") if not (partial / n).exists()]
    if missing:
        raise PeerExportError(f"the builder exited 0 but wrote no {', '.join(missing)} in {partial}; see {log}")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def read_genai_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "genai_config.json").read_text())


def head_config(genai: dict) -> dict:
    """genai_config.json of the MTP head as a model of its own: model.decoder is the main
    config's "mtp" section restricted to decoder keys, one layer deep, the main model's type,
    its session options (provider) and width."""
    model = genai["model"]
    if "mtp" not in model:
        raise PeerExportError("genai_config.json has no 'mtp' section: the checkpoint has no MTP head "
                              "(mtp_num_hidden_layers = 0 or no mtp.* weights) or the builder skipped it")
    decoder = {"session_options": copy.deepcopy(model["decoder"].get("session_options", {})),
               "hidden_size": model["decoder"]["hidden_size"],
               "num_attention_heads": model["decoder"]["num_attention_heads"]}
    decoder.update({k: copy.deepcopy(v) for k, v in model["mtp"].items() if k in DECODER_KEYS})
    decoder["num_hidden_layers"] = 1
    head_model = {k: copy.deepcopy(v) for k, v in model.items() if k not in ("decoder", "mtp")}
    head_model["decoder"] = decoder
    return {"model": head_model, "search": copy.deepcopy(genai["search"])}


def graph_config(genai: dict) -> dict:
    """The same config with CUDA graphs on ("enable_cuda_graph": "1" in the cuda provider options)."""
    out = copy.deepcopy(genai)
    providers = out["model"]["decoder"].setdefault("session_options", {}).setdefault("provider_options", [])
    cuda = next((p["cuda"] for p in providers if "cuda" in p), None)
    if cuda is None:
        providers.append({"cuda": {"enable_cuda_graph": "1"}})
    else:
        cuda["enable_cuda_graph"] = "1"
    return out


def cpu_config(genai: dict, threads: int | None = None) -> dict:
    """The same config for the peer's CPU runtime: no provider options, no shared_initializers;
    with threads, that many intra-op threads (and one inter-op thread), as ortspec's Session(threads=)."""
    out = copy.deepcopy(genai)
    for section in ("decoder", "mtp"):
        if section in out["model"]:
            out["model"][section].pop("shared_initializers", None)
    options = out["model"]["decoder"].setdefault("session_options", {})
    options["provider_options"] = []
    if threads:
        options.update(intra_op_num_threads=threads, inter_op_num_threads=1)
    return out


def write_variant(src: Path, dst: Path, config: dict, files: tuple[str, ...]) -> Path:
    """dst with `files` hard-linked from src (copied where links fail) and genai_config.json."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for name in files + SIDE_FILES:
        if not (src / name).exists():
            if name in SIDE_FILES:
                continue
            raise PeerExportError(f"{src} has no {name}; the builder's output is incomplete")
        try:
            os.link(src / name, dst / name)
        except OSError:
            shutil.copyfile(src / name, dst / name)
    (dst / "genai_config.json").write_text(json.dumps(config, indent=4))
    return dst


def model_dirs(built: Path, device: str, threads: int | None = None) -> PeerDirs:
    """The runtime's directories for `device` ("cuda": eager + graph, main + head; "cpu": eager,
    with `threads` intra-op threads)."""
    genai = read_genai_config(built)
    has_head = "mtp" in genai["model"]
    work = built.parent
    if device == "cpu":
        main = write_variant(built, work / "peer_cpu", cpu_config(genai, threads), MAIN_FILES + HEAD_FILES[:2])
        head = (write_variant(built, work / "peer_head_cpu", cpu_config(head_config(genai), threads), HEAD_FILES)
                if has_head else None)
        return PeerDirs(main, head)
    head = write_variant(built, work / "peer_head", head_config(genai), HEAD_FILES) if has_head else None
    graph_main = write_variant(built, work / "peer_graph", graph_config(genai), MAIN_FILES + HEAD_FILES[:2])
    graph_head = (write_variant(built, work / "peer_head_graph", graph_config(head_config(genai)), HEAD_FILES)
                  if has_head else None)
    return PeerDirs(built, head, graph_main, graph_head)


def source_stamp(checkpoint, max_length: int, precision: str = "fp16") -> dict:
    """What identifies the exports of a checkpoint: its path, config.json, weight file sizes
    and modification times, the KV capacity and the precision they were made for."""
    checkpoint = Path(checkpoint).resolve()
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(checkpoint.glob("*.safetensors"))}
    return {"checkpoint": str(checkpoint), "config": (checkpoint / "config.json").read_text(), "weights": files,
            "max_length": max_length, "precision": precision}


def export_peer(checkpoint, work, device: str = "cuda", precision: str = "fp16", threads: int | None = None) -> PeerDirs:
    """Re-lay `checkpoint`, run the builder (fp16 for the CUDA EP, or fp32 for the CPU EP) and
    write the runtime's directories."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    relaid = relay_checkpoint(checkpoint, work / "relaid")
    built = run_builder(relaid, work / "peer", work / "builder.log", precision)
    return model_dirs(built, device, threads)
