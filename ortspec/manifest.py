"""manifest.json: the contract between the converter and the runtime.

It records the model dimensions, K, max_length, every graph file with the weights it
uses, the weight layout of weights.bin, every state tensor (kind, shape, dtype) so the
runtime allocates states without guessing, and the size and sha256 of every file in the
directory (integrity.py), so a load refuses a directory that is not what was converted.

``draft_vocab`` (added within ortspec/2): {"size": N, "source", "tensor"} where the MTP head
drafts from N tokens only (converter/draft_vocab.py); absent or null in older manifests: none.

``activations`` (added within ortspec/2) is the dtype between layers: "float32", or the model's
float16/bfloat16 (``convert(activations="model")``); a manifest written before it reads as
"float32", which is what its graphs run. ``gdn_verify`` (also within ortspec/2) is the form of the
portable (CUDA) select verifies' GDN layers (``GDN_VERIFY_FORMS``); a manifest without it reads
as "per_row", what those graphs were before the field.

Format ortspec/2 added the file records. A directory of format ortspec/1 is refused with the
command that reconverts it: without sizes, a half-overwritten directory of that format (what
a killed conversion of that version left) cannot be told from a whole one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

from .errors import ModelDirError, ProviderError
from .integrity import CHECKSUM, check_checksums, check_sizes
from .model_spec import FULL, ModelSpec

FORMAT = "ortspec/2"
MANIFEST_FILE = "manifest.json"
MAX_SPECULATIVE_TOKENS = 8  # the largest K a conversion writes (verify and draft graphs for k = 1..K)
WEIGHTS_FILE = "weights.bin"
GRAPH_FILES = "{name}.onnx"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json")
_FIELDS = (("model", dict), ("max_length", int), ("num_speculative_tokens", int), ("dtype", str),
           ("weights.file", str), ("weights.tensors", dict), ("graphs", dict), ("states", dict),
           ("tokenizer.files", list), ("files", dict))


def graph_file(name: str, variant: str | None = None) -> str:
    """decode.onnx; a graph's variant for one provider: decode.cpu.onnx."""
    return GRAPH_FILES.format(name=name if variant is None else f"{name}.{variant}")


def graph_name(kind: str, k: int) -> str:
    """verify graphs exist once per k: verify_k2, verify_select_k2, ..."""
    return f"{kind}_k{k}"


def window_row_name(window: str, row: int) -> str:
    """The output holding slot ``row`` of a state window (the state after that row of a verify)
    where a graph emits one output per row, as the CPU variants do: ``recurrent_window.2.1`` for
    slot 1 of layer 2's window. The portable graphs emit the stacked ``recurrent_window.2``
    [M, B, ...] (CUDA selects slots of it on the device); either is read by runtime.states."""
    return f"{window}.{row}"


# How the portable (CUDA) select verifies (verify_select_k{k}, verify_mtp_k{k}) emit what the commit
# needs of their GDN layers (converter/layers.make_gated_deltanet):
#   per_row       the recurrence once per row, the state after each row stacked: {kind}_window.{i}
#   state_window  LinearAttention and CausalConvWithState once, with their state_window attribute
#                 (CUDA only): the same {kind}_window.{i} [M, B, ...]; their past_state inputs are
#                 windows {kind}.{i}.past{M} [M, B, ...] (past_window_name) of which they read slot M-1
#                 only: the runtime lays the live state there (runtime.states)
#   transition    the ops once over all rows, plus the rows' transition record (TRANSITION_RECORD):
#                 the commit replays the accepted rows onto the live state (runtime.states)
GDN_VERIFY_FORMS = ("per_row", "state_window", "transition")
MAX_STATE_WINDOW = 8  # the ops' state_window range is 0..8: verifies of at most 8 rows (k <= 7)
# A transition verify's outputs per GDN layer i, by the state they commit: f"{name}.{i}".
TRANSITION_RECORD = {"recurrent": ("gdn_keys", "gdn_values", "gdn_decay", "gdn_beta"), "conv": ("conv_inputs",)}


def record_names(state: str) -> tuple[str, ...]:
    """The transition-record outputs that commit state ``state`` (recurrent.2 -> gdn_keys.2, ...)."""
    kind, layer = state.split(".")
    return tuple(f"{name}.{layer}" for name in TRANSITION_RECORD[kind])


def past_window_name(state: str, rows: int) -> str:
    """The input of a state_window verify of ``rows`` rows that holds GDN state ``state`` as its
    past window [rows, B, ...], the live state in the last slot: recurrent.2.past3."""
    return f"{state}.past{rows}"


def has_state_windows(graph: str) -> bool:
    """Whether a target graph emits the GDN states after each row (the select verifies, their
    pipeline stages and KV window variants): the graphs ``gdn_verify`` describes."""
    return graph.startswith(("verify_select_k", "verify_mtp_k", "verify_mtp_sample_k", "verify_mtp_tempered_k"))


def runs_on_gpus_only(graph: str) -> bool:
    """The graphs without a CPU variant in any conversion: the tempered sampling graphs of models
    converted in sessions 9-11 (no conversion writes them now, and no run takes them)."""
    return graph.split(".")[0].startswith(("decode_tempered", "verify_mtp_tempered_k"))


def stage_graph_name(graph: str, stage: int) -> str:
    """A pipeline stage of a target graph: decode.stage0, decode.stage1, ..."""
    return f"{graph}.stage{stage}"


def window_graph_name(graph: str, slots: int) -> str:
    """A graph's variant that attends over the first ``slots`` KV slots (CUDA): decode.w256, ..."""
    return f"{graph}.w{slots}"


def split_window_name(name: str) -> tuple[str, int | None]:
    """decode.w256 -> ("decode", 256); decode -> ("decode", None)."""
    match = _WINDOW_NAME.fullmatch(name)
    return (match[1], int(match[2])) if match else (name, None)


_WINDOW_NAME = re.compile(r"(.+)\.w(\d+)")


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


def state_bytes(states: dict[str, dict]) -> int:
    """Bytes of the state buffers one batch row holds: a state table's entries (shapes [B, ...])."""
    return sum(_ITEMSIZE[entry["dtype"]] * math.prod(entry["shape"][1:]) for entry in states.values())


_ITEMSIZE = {"float32": 4}  # every state is float32 (state_table)
_VARIANTS = ("cpu",)  # providers a graph entry may hold a variant for (Manifest.graph_entry)


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
    files: dict = dataclasses.field(default_factory=dict)  # file name -> {"size", "sha256"}
    mtp_quant: str | None = None  # "int4": the MTP draft head's weights are (also when quant is)
    attention_window: bool = False  # the graphs attend over the first W KV slots they are given
    activations: str = "float32"  # the dtype between layers: float32 or the model's dtype (converter/layers.py)
    gdn_verify: str = "per_row"  # the form of the portable select verifies' GDN layers (GDN_VERIFY_FORMS)
    draft_vocab: dict | None = None  # {"size": N, "source", "tensor"}: the head drafts from N tokens (converter/draft_vocab.py)

    @property
    def num_stages(self) -> int:
        return max(1, len(self.stage_layers) - 1)
    @property
    def has_mtp(self) -> bool:
        return "mtp" in self.graphs

    @property
    def tokenizer_path(self) -> Path | None:
        return self.dir / "tokenizer.json" if "tokenizer.json" in self.tokenizer_files else None

    def graph_entry(self, name: str, provider: str | None = None) -> dict:
        """{"file", "weights"} of the graph a session on ``provider`` runs: the graph's variant for
        that provider where the model has one (``graphs[name]["cpu"]``: built with what the CPU EP
        runs fastest, converter/gdn_cpu.py), else the portable graph (models converted before
        variants existed have only that). A window name (``window_graph_name``, decode.w256) is
        that window variant of the portable graph (``graphs[name]["windows"]["256"]``)."""
        graph, slots = split_window_name(name)
        if graph not in self.graphs or (slots is not None and slots not in self.window_buckets(graph)):
            raise ModelDirError(f"graph {name!r} is not in {self.dir}/manifest.json; reconvert the model.")
        entry = self.graphs[graph]
        if slots is not None:
            return entry["windows"][str(slots)]
        if provider == "cpu" and provider not in entry and self.gdn_verify == "state_window" and has_state_windows(name):
            raise ProviderError(
                f"graph {name!r} of {self.dir} uses the state_window attribute of LinearAttention and "
                "CausalConvWithState, which ONNX Runtime's CPU kernels refuse, and the model has no CPU variant of "
                "it; run it with provider='cuda', or reconvert with gdn_verify='per_row' or 'transition' "
                "(ortspec convert --gdn-verify).")
        return entry.get(provider, entry) if provider is not None else entry

    def window_buckets(self, name: str) -> list[int]:
        """The KV windows W (ascending) the graph has a variant for, each attending over the
        first W slots of the caches (converter/kv_windows.py); [] for graphs without (prefill,
        pipeline stages, small max_length, models converted before variants existed)."""
        entry = self.graphs.get(name)
        return sorted(int(w) for w in entry.get("windows", {})) if isinstance(entry, dict) else []

    def graph_path(self, name: str, provider: str | None = None) -> Path:
        return self.dir / self.graph_entry(name, provider)["file"]

    @classmethod
    def create(cls, spec, *, max_length, num_speculative_tokens, dtype, weights, graphs, tokenizer_files,
               source, model_type, stage_layers, quant=None, files=None, mtp_quant=None,
               activations="float32", gdn_verify="per_row", draft_vocab=None) -> "Manifest":
        return cls(Path("."), spec, max_length, num_speculative_tokens, dtype, weights, graphs,
                   state_table(spec, max_length, "mtp" in graphs), tokenizer_files,
                   {"checkpoint": source, "model_type": model_type}, stage_layers, quant, dict(files or {}),
                   mtp_quant, attention_window=True, activations=activations, gdn_verify=gdn_verify,
                   draft_vocab=draft_vocab)

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT,
            "source": self.source,
            "model": self.spec.to_dict(),
            "max_length": self.max_length,
            "num_speculative_tokens": self.num_speculative_tokens,
            "dtype": self.dtype,
            "quant": self.quant,
            "mtp_quant": self.mtp_quant,
            "attention_window": self.attention_window,
            "activations": self.activations,
            "gdn_verify": self.gdn_verify,
            "draft_vocab": self.draft_vocab,
            "weights": {"file": WEIGHTS_FILE, "tensors": self.weights},
            "graphs": self.graphs,
            "states": self.states,
            "tokenizer": {"files": self.tokenizer_files},
            "pipeline": {"stage_layers": self.stage_layers},
            "files": self.files,
        }, indent=1)

    @classmethod
    def load(cls, model_dir: str | Path) -> "Manifest":
        """Reads manifest.json and checks the directory against it: every file it records is
        there with its recorded size (one stat each; checksums are ``verify``'s job)."""
        model_dir = Path(model_dir)
        doc = _read_document(model_dir)
        try:
            spec = ModelSpec.from_dict(doc["model"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelDirError(f"{model_dir / MANIFEST_FILE} has an invalid 'model' section ({exc!r}); "
                                f"{_reconvert(model_dir, doc)}") from exc
        check_sizes(model_dir, doc["files"])
        return cls(model_dir, spec, doc["max_length"], doc["num_speculative_tokens"], doc["dtype"],
                   doc["weights"]["tensors"], doc["graphs"], doc["states"], doc["tokenizer"]["files"],
                   doc.get("source", {}), doc.get("pipeline", {}).get("stage_layers", []), doc.get("quant"),
                   doc["files"], doc.get("mtp_quant"), bool(doc.get("attention_window", False)),
                   doc.get("activations", "float32"), doc.get("gdn_verify", "per_row"), doc.get("draft_vocab"))

    def verify(self) -> dict[str, int]:
        """Re-hashes every file against its recorded checksum (reads every byte); raises
        ModelDirError at the first that differs. Returns {file name: size} of the files checked."""
        check_checksums(self.dir, self.files)
        return {name: record["size"] for name, record in self.files.items()}


def _read_document(model_dir: Path) -> dict:
    """manifest.json parsed and checked field by field: anything else is a ModelDirError."""
    path = model_dir / MANIFEST_FILE
    if not path.is_file():
        hint = (" It looks like a HuggingFace checkpoint: convert it first with "
                f"`ortspec convert {model_dir} OUT_DIR`." if (model_dir / "config.json").is_file() else "")
        raise ModelDirError(f"{str(model_dir)!r} has no manifest.json, so it is not a converted ortspec model.{hint}")
    try:
        doc = json.loads(path.read_bytes())
    except OSError as exc:
        raise ModelDirError(f"cannot read {path}: {exc.strerror}. Check the directory's permissions.") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelDirError(f"{path} is not valid JSON ({exc}): it was cut short or overwritten; "
                            f"{_reconvert(model_dir, {})}") from exc
    if not isinstance(doc, dict):
        raise ModelDirError(f"{path} holds a JSON {type(doc).__name__}, not an ortspec manifest; this is not a "
                            "converted ortspec model.")
    if doc.get("format") != FORMAT:
        old = doc.get("format") == "ortspec/1"
        why = ("records no file sizes or checksums, so a half-written directory cannot be told from a whole one"
               if old else f"is not the format this ortspec reads ({FORMAT!r})")
        raise ModelDirError(f"{path} has format {doc.get('format')!r}, which {why}; {_reconvert(model_dir, doc)}")
    for dotted, kind in _FIELDS:
        _check_field(doc, dotted, kind, path)
    _check_activations(doc, path)
    _check_gdn_verify(doc, path)
    _check_draft_vocab(doc, path)
    _check_files(doc, path)
    return doc


def _check_activations(doc: dict, path: Path) -> None:
    """activations, where recorded, is float32 or the model's dtype (what a conversion writes)."""
    activations = doc.get("activations", "float32")
    if activations not in ("float32", doc["dtype"]):
        raise ModelDirError(f"{path} has activations {activations!r}, which is neither 'float32' nor the model's "
                            f"dtype {doc['dtype']!r}; {_reconvert(path.parent, doc)}")


def _check_gdn_verify(doc: dict, path: Path) -> None:
    """gdn_verify, where recorded, is one of GDN_VERIFY_FORMS (what a conversion writes)."""
    form = doc.get("gdn_verify", "per_row")
    if form not in GDN_VERIFY_FORMS:
        raise ModelDirError(f"{path} has gdn_verify {form!r}, not one of {', '.join(GDN_VERIFY_FORMS)}; "
                            f"{_reconvert(path.parent, doc)}")
def _check_draft_vocab(doc: dict, path: Path) -> None:
    """draft_vocab, where recorded (absent or null: none), names an int64 [N] tensor of weights.bin
    with N its size, below the vocabulary."""
    entry = doc.get("draft_vocab")
    if entry is None:
        return
    tensor = doc["weights"]["tensors"].get(entry.get("tensor")) if isinstance(entry, dict) else None
    size = entry.get("size") if isinstance(entry, dict) else None
    vocab = doc["model"].get("vocab_size") if isinstance(doc["model"], dict) else None
    if not (isinstance(size, int) and isinstance(vocab, int) and 0 < size < vocab and isinstance(tensor, dict)
            and tensor.get("dtype") == "int64" and tensor.get("shape") == [size]):
        raise ModelDirError(f"{path} has an invalid draft_vocab {entry!r}; {_reconvert(path.parent, doc)}")


def _check_field(doc: dict, dotted: str, kind: type, path: Path) -> None:
    value = doc
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ModelDirError(f"{path} lacks {dotted!r}; it is incomplete or not written by ortspec. "
                                f"{_reconvert(path.parent, doc)}")
        value = value[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ModelDirError(f"{path} has {dotted!r} of type {type(value).__name__}, expected {kind.__name__}. "
                            f"{_reconvert(path.parent, doc)}")


def _check_files(doc: dict, path: Path) -> None:
    """Every graph entry names its file and weights; every file a load reads (graphs, weights.bin)
    has a well-formed size and checksum record."""
    files, reconvert = doc["files"], _reconvert(path.parent, doc)
    entries = []  # every graph file a session may load: the portable graphs, their provider and window variants
    for name, graph in doc["graphs"].items():
        variants = [graph] + [graph[p] for p in _VARIANTS if isinstance(graph, dict) and p in graph]
        windows = graph.get("windows", {}) if isinstance(graph, dict) else {}
        if not isinstance(windows, dict) or not all(isinstance(w, str) and w.isdigit() for w in windows):
            raise ModelDirError(f"{path} has invalid KV windows for graph {name!r}: {windows!r}; {reconvert}")
        variants += list(windows.values())
        for entry in variants:
            if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
                    and isinstance(entry.get("weights"), list)):
                raise ModelDirError(f"{path} has an invalid entry for graph {name!r}: {graph!r}; {reconvert}")
        entries += variants
    for name in [doc["weights"]["file"], *(g["file"] for g in entries)]:
        if name not in files:
            raise ModelDirError(f"{path} records no size for {name!r} among its files; {reconvert}")
    for name, record in files.items():
        plain = isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
        well_formed = (isinstance(record, dict) and isinstance(record.get("size"), int)
                       and isinstance(record.get(CHECKSUM), str))
        if not (plain and well_formed):
            raise ModelDirError(f"{path} has an invalid file record {name!r}: {record!r}; {reconvert}")


def _reconvert(model_dir: Path, doc: dict) -> str:
    source = doc.get("source", {}).get("checkpoint") if isinstance(doc.get("source"), dict) else None
    return f"reconvert it: ortspec convert {source or 'CHECKPOINT_DIR'} {model_dir} --overwrite"
