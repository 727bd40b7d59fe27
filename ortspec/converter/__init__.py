"""``ortspec convert``: a HuggingFace Qwen3.5-text checkpoint -> ONNX graphs + manifest.json."""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import CheckpointError, UnsupportedModelError
from ..manifest import GRAPH_FILES, Manifest, graph_name, stage_graph_name
from ..model_spec import ModelSpec, read_hf_config
from .builder import WeightStore
from .checkpoint import CheckpointReader
from .graphs import make_mtp_graph, make_mtp_propose_graph, make_target_graph
from .quantize import quantize_draft_head, quantize_store
from .weights import WeightPreparer, cast_matrices

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json")
DTYPES = ("float32", "float16", "bfloat16")


def convert(checkpoint_dir, out_dir, *, num_speculative_tokens: int = 4, dtype: str = "float32",
            max_length: int = 1024, pipeline_stages: int = 1, stage_layers: list[int] | None = None,
            quant: str | None = None, mtp_quant: str | None = None, progress: bool = True) -> Path:
    """Converts a checkpoint; returns the output directory (ready for ``ortspec.Session``).

    num_speculative_tokens (K) is the largest k a Session may use; graphs for every
    verify shape 1..K are written. max_length bounds prompt + generated tokens.
    dtype "float16"/"bfloat16" stores the weight matrices in that dtype (half the size) and
    runs the matrix products in it; norms, the GDN recurrence and every state stay float32.
    bfloat16 graphs need the CUDA provider (the CPU has no bfloat16 MatMul).
    pipeline_stages > 1 also writes every target graph split into that many stages
    ({graph}.stage{s}.onnx); stage_layers gives the boundaries (default: even split), e.g.
    [0, 2, 4] for layers 0-1 and 2-3. quant="int4" stores the projection matrices, the
    lm_head and the MTP fc as 4-bit blocks of 32 (MatMulNBits); the embedding keeps dtype.
    mtp_quant="int4" does that for the MTP draft head alone (with its own int4 copy of the
    lm_head): drafts get cheaper, the output stays exactly the target's.
    """
    for name, value in (("quant", quant), ("mtp_quant", mtp_quant)):
        if value not in (None, "int4"):
            raise CheckpointError(f"{name}={value!r} is not supported; use 'int4' or leave it out.")
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
    if not 0 <= num_speculative_tokens <= 8:
        raise CheckpointError(f"num_speculative_tokens={num_speculative_tokens} is out of range; use 0..8.")
    if max_length < 2:
        raise CheckpointError(f"max_length={max_length} is too small; use at least 2 (typical: 1024-8192).")
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    hf_config = read_hf_config(checkpoint_dir)
    spec = ModelSpec.from_hf_config(hf_config)
    reader = CheckpointReader(checkpoint_dir)
    with_mtp = _mtp_available(spec, reader)
    K = num_speculative_tokens if with_mtp else 0
    if num_speculative_tokens and not with_mtp:
        print(f"ortspec convert: {checkpoint_dir} has no mtp.* weights; converting without an MTP head "
              "(greedy only, num_speculative_tokens=0).")

    out_dir.mkdir(parents=True, exist_ok=True)
    store = WeightStore()
    WeightPreparer(spec, reader, store).prepare_all(max_length, with_mtp)
    if quant == "int4":
        quantize_store(store)
    elif mtp_quant == "int4" and with_mtp:
        quantize_draft_head(store)
    cast_matrices(store, dtype)
    layout = store.save(out_dir)

    boundaries = _stage_boundaries(spec.num_layers, pipeline_stages, stage_layers)
    shapes = {"prefill": dict(rows=None), "decode": dict(rows=1)}
    for k in range(1, K + 1):
        shapes[graph_name("verify", k)] = dict(rows=k + 1)
        shapes[graph_name("verify_select", k)] = dict(rows=k + 1, windows=True)
    builders = {}
    for name, shape in shapes.items():
        builders[name] = lambda name=name, shape=shape: make_target_graph(spec, store, max_length, name, **shape)
        if len(boundaries) > 2:
            for s, (start, stop) in enumerate(zip(boundaries, boundaries[1:])):
                builders[stage_graph_name(name, s)] = lambda name=name, shape=shape, s=s, r=range(start, stop): (
                    make_target_graph(spec, store, max_length, stage_graph_name(name, s), layers=r, stage=s, **shape))
    if with_mtp:
        builders["mtp"] = lambda: make_mtp_graph(spec, store, max_length)
        for k in range(1, K + 1):
            builders[graph_name("mtp_propose", k)] = lambda k=k: make_mtp_propose_graph(spec, store, max_length, k)

    import onnx

    graphs = {}
    for name, build in tqdm(builders.items(), desc="ortspec convert", unit="graph", disable=not progress):
        g = build()
        file = GRAPH_FILES.format(name=name)
        onnx.save(g.build(layout), str(out_dir / file))
        graphs[name] = {"file": file, "weights": g.used_weights}

    tokenizer_files = []
    for fname in TOKENIZER_FILES:
        if (checkpoint_dir / fname).is_file():
            shutil.copy2(checkpoint_dir / fname, out_dir / fname)
            tokenizer_files.append(fname)
    Manifest.create(spec, max_length=max_length, num_speculative_tokens=K, dtype=dtype, weights=layout,
                    graphs=graphs, tokenizer_files=tokenizer_files, source=str(checkpoint_dir),
                    model_type=hf_config.get("model_type"), stage_layers=boundaries, quant=quant,
                    mtp_quant="int4" if with_mtp and "int4" in (quant, mtp_quant) else None).save(out_dir)
    return out_dir


def _stage_boundaries(num_layers: int, stages: int, stage_layers) -> list[int]:
    if stage_layers is not None:
        bounds = list(stage_layers)
        if bounds[0] != 0 or bounds[-1] != num_layers or any(b > c for b, c in zip(bounds, bounds[1:])):
            raise CheckpointError(f"stage_layers={bounds} must rise from 0 to num_layers={num_layers}.")
        return bounds
    if not 1 <= stages <= num_layers:
        raise CheckpointError(f"pipeline_stages={stages} must be between 1 and the {num_layers} layers.")
    return [round(s * num_layers / stages) for s in range(stages + 1)]


def _mtp_available(spec: ModelSpec, reader: CheckpointReader) -> bool:
    if not reader.has_mtp():
        return False
    if spec.mtp_num_hidden_layers > 1:
        raise UnsupportedModelError(
            f"mtp_num_hidden_layers={spec.mtp_num_hidden_layers}: ortspec supports MTP heads of one layer "
            "(as published Qwen3.5 checkpoints have)."
        )
    return True
