"""manifest.json: the contract between the converter and the runtime.

It records the model dimensions, K, max_length, every graph file with the weights it
uses, the weight layout of weights.bin, and every state tensor (kind, shape, dtype) so
the runtime allocates states without guessing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .errors import ModelDirError
from .model_spec import FULL, ModelSpec

FORMAT = "ortspec/1"
GRAPH_FILES = "{name}.onnx"


def graph_name(kind: str, k: int) -> str:
    """verify graphs exist once per k: verify_k2, verify_select_k2, ..."""
    return f"{kind}_k{k}"


def stage_graph_name(graph: str, stage: int) -> str:
    """A pipeline stage of a target graph: decode.stage0, decode.stage1, ..."""
    return f"{graph}.stage{stage}"


def state_table(spec: ModelSpec, max_length: int, with_mtp: bool) -> dict[str, dict]:
    """State name -> {kind, layer, shape (B = batch), dtype}. Kinds: kv_key, kv_value, conv,
    recurrent (target) and mtp_kv_key, mtp_kv_value (the MTP head's own cache)."""
    kvh, hd, L = spec.num_key_value_heads, spec.head_dim, max_length
    table = {}
    for i, kind in enumerate(spec.layer_types):
        if kind == FULL:
            table[f"key.{i}"] = {"kind": "kv_key", "layer": i, "shape": ["B", kvh, hd, L]}
            table[f"value.{i}"] = {"kind": "kv_value", "layer": i, "shape": ["B", kvh, L, hd]}
        else:
            table[f"conv.{i}"] = {"kind": "conv", "layer": i,
                                  "shape": ["B", spec.linear_conv_kernel_dim - 1, spec.conv_dim]}
            table[f"recurrent.{i}"] = {"kind": "recurrent", "layer": i,
                                       "shape": ["B", spec.linear_num_value_heads, spec.linear_key_head_dim,
                                                 spec.linear_value_head_dim]}
    if with_mtp:
        table["key.mtp"] = {"kind": "mtp_kv_key", "layer": "mtp", "shape": ["B", kvh, hd, L]}
        table["value.mtp"] = {"kind": "mtp_kv_value", "layer": "mtp", "shape": ["B", kvh, L, hd]}
    for entry in table.values():
        entry["dtype"] = "float32"
    return table


@dataclasses.dataclass
class Manifest:
    dir: Path
    spec: ModelSpec
    max_length: int
    num_speculative_tokens: int
    dtype: str
    weights: dict
    graphs: dict
    states: dict
    tokenizer_files: list
    source: dict = dataclasses.field(default_factory=dict)
    stage_layers: list = dataclasses.field(default_factory=list)  # pipeline boundaries, [0, ..., L]
    quant: str | None = None  # "int4": MatMulNBits weights
    mtp_quant: str | None = None  # "int4": the MTP draft head's weights are (also when quant is)
    attention_window: bool = False  # the graphs attend over the first W KV slots they are given

    @property
    def num_stages(self) -> int:
        return max(1, len(self.stage_layers) - 1)
    @property
    def has_mtp(self) -> bool:
        return "mtp" in self.graphs

    @property
    def tokenizer_path(self) -> Path | None:
        return self.dir / "tokenizer.json" if "tokenizer.json" in self.tokenizer_files else None

    def graph_path(self, name: str) -> Path:
        if name not in self.graphs:
            raise ModelDirError(f"graph {name!r} is not in {self.dir}/manifest.json; reconvert the model.")
        return self.dir / self.graphs[name]["file"]

    @classmethod
    def create(cls, spec, *, max_length, num_speculative_tokens, dtype, weights, graphs, tokenizer_files,
               source, model_type, stage_layers, quant=None, mtp_quant=None) -> "Manifest":
        return cls(Path("."), spec, max_length, num_speculative_tokens, dtype, weights, graphs,
                   state_table(spec, max_length, "mtp" in graphs), tokenizer_files,
                   {"checkpoint": source, "model_type": model_type}, stage_layers, quant, mtp_quant,
                   attention_window=True)

    def save(self, out_dir: Path) -> None:
        doc = {
            "format": FORMAT,
            "source": self.source,
            "model": self.spec.to_dict(),
            "max_length": self.max_length,
            "num_speculative_tokens": self.num_speculative_tokens,
            "dtype": self.dtype,
            "quant": self.quant,
            "mtp_quant": self.mtp_quant,
            "attention_window": self.attention_window,
            "weights": {"file": "weights.bin", "tensors": self.weights},
            "graphs": self.graphs,
            "states": self.states,
            "tokenizer": {"files": self.tokenizer_files},
            "pipeline": {"stage_layers": self.stage_layers},
        }
        (Path(out_dir) / "manifest.json").write_text(json.dumps(doc, indent=1))

    @classmethod
    def load(cls, model_dir: str | Path) -> "Manifest":
        model_dir = Path(model_dir)
        path = model_dir / "manifest.json"
        if not path.is_file():
            hint = (" It looks like a HuggingFace checkpoint: convert it first with "
                    f"`ortspec convert {model_dir} OUT_DIR`." if (model_dir / "config.json").is_file() else "")
            raise ModelDirError(f"{str(model_dir)!r} has no manifest.json, so it is not a converted ortspec model.{hint}")
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            raise ModelDirError(f"{path} has format {doc.get('format')!r}; this ortspec reads {FORMAT!r}. Reconvert.")
        missing = [g["file"] for g in doc["graphs"].values() if not (model_dir / g["file"]).is_file()]
        if not (model_dir / doc["weights"]["file"]).is_file():
            missing.append(doc["weights"]["file"])
        if missing:
            raise ModelDirError(f"{model_dir} is missing {missing}; reconvert the model.")
        return cls(model_dir, ModelSpec.from_dict(doc["model"]), doc["max_length"], doc["num_speculative_tokens"],
                   doc["dtype"], doc["weights"]["tensors"], doc["graphs"], doc["states"], doc["tokenizer"]["files"],
                   doc.get("source", {}), doc.get("pipeline", {}).get("stage_layers", []), doc.get("quant"),
                   doc.get("mtp_quant"), doc.get("attention_window", False))
