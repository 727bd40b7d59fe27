"""``ortspec convert``: a HuggingFace Qwen3.5-text checkpoint -> ONNX graphs + manifest.json.

    check arguments, output directory, checkpoint and max_length     (before any work)
    -> weights.bin, graphs, tokenizer files, manifest.json           (in a staging directory,
                                                                       each file size + sha256 recorded)
    -> publish: one atomic move into place                           (converter/staging.py)
"""

from __future__ import annotations

import os
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import ConvertOptionError, UnsupportedModelError
from ..manifest import (MANIFEST_FILE, TOKENIZER_FILES, WEIGHTS_FILE, Manifest, graph_file, graph_name,
                        has_state_windows, runs_on_gpus_only, split_window_name, stage_graph_name, window_graph_name)
from ..model_spec import ModelSpec, read_hf_config
from .builder import CPU, PORTABLE, WeightStore
from .checkpoint import CheckpointReader, check_tokenizer
from .draft_vocab import DraftVocab, add_draft_head, build_draft_vocab, draft_vocab_size
from .fused_graph import make_verify_mtp_graph, make_verify_mtp_sample_graph
from .graphs import make_mtp_graph, make_mtp_propose_graph, make_sample_logits_graph, make_target_graph, sampled_tokens
from .kv_windows import has_window_variants, narrow_to_window, window_buckets
from .options import MAX_SPECULATIVE_TOKENS, ConvertOptions, check_max_length  # noqa: F401  (Session quotes K max)
from .output_dir import check_output_dir
from .quantize import quantize_draft_head, quantize_store
from .staging import StagingDir
from .weights import WeightPreparer, cast_matrices


def convert(checkpoint_dir, out_dir, *, num_speculative_tokens: int = 4, dtype: str = "float32",
            max_length: int = 1024, pipeline_stages: int = 1, stage_layers: list[int] | None = None,
            quant: str | None = None, mtp_quant: str | None = "auto", activations: str = "auto",
            gdn_verify: str = "auto", draft_vocab: int | str | None = "auto", draft_corpus=None,
            sampling_graphs: bool = True, overwrite: bool = False, progress: bool = True) -> Path:
    """Converts a checkpoint; returns the output directory (ready for ``ortspec.Session``).

    num_speculative_tokens (K) is the largest k a Session may use; graphs for every
    verify shape 1..K are written. max_length bounds prompt + generated tokens.
    dtype "float16"/"bfloat16" stores the weight matrices in that dtype (half the size) and
    runs the matrix products in it; the GDN recurrence, attention and every state stay float32.
    activations: the dtype between layers. "auto" (default): "model" for float16/bfloat16
    weights, "float32" with float32 or int4 weights. "float32": the residual stream and its
    norms in float32, each product's input cast down and its output back up. "model": the
    residual stream, embedding rows, norms on the stream and the projections' inputs and
    outputs in the model's dtype, as transformers runs a float16 model: a Cast only where a
    mixer's float32 inside begins and ends, and on the logits (kept float32); fewer kernels per
    step on a GPU. A float32 model's "model" is float32 (the same graphs). Not with int4
    weights (quant or mtp_quant: MatMulNBits takes float32 here). Recorded in the manifest.
    bfloat16 graphs need the CUDA provider (the CPU has no bfloat16 MatMul).
    gdn_verify: how the portable (CUDA) select verifies emit their GDN layers' states for the
    commit (manifest.GDN_VERIFY_FORMS): "auto" (default: "transition" for float16/bfloat16, the GPU's
    dtypes, where it measured fastest; "per_row" for float32), "per_row" (the recurrence once per
    row, the state after each row stacked), "state_window" (the fused ops once, with their
    state_window; CUDA only, k <= 7) or "transition" (the ops once and the rows' transition record,
    which the commit replays onto the live state in one native kernel). The CPU variants run per
    row whatever it is. Recorded in the manifest.
    sampling_graphs (default True) writes the graphs that sample on the device: decode_sample,
    sample_logits (a prefill's sampled first tokens) and,
    with a head, verify_mtp_sample_k{k} for k = 1..K (converter/sampling_graph.py); False leaves
    them out (a quarter less conversion time for the tests' tiny models; greedy decoding and the
    host's sampling need none of them).
    pipeline_stages > 1 also writes every target graph split into that many stages
    ({graph}.stage{s}.onnx); stage_layers gives the boundaries (default: even split), e.g.
    [0, 2, 4] for layers 0-1 and 2-3. quant="int4" stores the projection matrices, the
    lm_head and the MTP fc as 4-bit blocks of 32 (MatMulNBits); the embedding keeps dtype.
    mtp_quant="int4" does that for the MTP draft head alone (with its own int4 copy of the
    lm_head): drafts get cheaper, the output stays exactly the target's. mtp_quant="auto" (the
    default) is "int4" for float32 weights (a CPU model: a draft pass costs a third there) and
    "none" for float16/bfloat16 (ConvertOptions.head_quant says why).
    draft_vocab: the MTP head drafts from the N most frequent tokens only (converter/draft_vocab.py:
    its lm_head is the [H, N] columns of those tokens; the output stays exactly the target's).
    "auto" (the default): 32768 tokens for a vocabulary of 65536 or more, none below; an int N
    below the vocabulary forces N; 0 or None: none. draft_corpus: a text file whose token
    frequencies rank them (needs tokenizer.json); without it, token ids rank them (a byte-level
    BPE's merge order). Recorded in the manifest ("draft_vocab").

    Every graph is written portable (fused ops: what CUDA runs) and, for float32 models, also
    as a CPU variant ({graph}.cpu.onnx, built with what ONNX Runtime's CPU EP runs fastest:
    converter/gdn_cpu.py), which a CPU Session loads instead. For max_length > 256 the graphs a
    CUDA Session captures also get KV window variants ({graph}.w256.onnx, ...: attend over the
    first 256, 512, ... slots; converter/kv_windows.py), which only CUDA Sessions load.

    out_dir is written whole or not at all (see converter/output_dir.py for what may be
    replaced): an existing model there is refused unless overwrite=True, which replaces it.
    """
    options = ConvertOptions(num_speculative_tokens=num_speculative_tokens, dtype=dtype, max_length=max_length,
                             pipeline_stages=pipeline_stages, stage_layers=stage_layers, quant=quant,
                             mtp_quant=mtp_quant, activations=activations, gdn_verify=gdn_verify,
                             draft_vocab=draft_vocab, draft_corpus=None if draft_corpus is None else str(draft_corpus),
                             sampling_graphs=sampling_graphs,
                             overwrite=overwrite, progress=progress)
    checkpoint_dir, out_dir = _path("checkpoint_dir", checkpoint_dir), _path("out_dir", out_dir)
    check_output_dir(out_dir, checkpoint_dir, options.overwrite)
    hf_config = read_hf_config(checkpoint_dir)
    spec = ModelSpec.from_hf_config(hf_config)
    reader = CheckpointReader(checkpoint_dir)
    check_tokenizer(checkpoint_dir, spec.vocab_size)
    with_mtp = _mtp_available(spec, reader)
    check_max_length(spec, options.max_length, with_mtp)
    boundaries = _stage_boundaries(spec.num_layers, options.pipeline_stages, options.stage_layers)
    K = options.num_speculative_tokens if with_mtp else 0
    if options.num_speculative_tokens and not with_mtp:
        print(f"ortspec convert: {checkpoint_dir} has no mtp.* weights; converting without an MTP head "
              "(greedy only, num_speculative_tokens=0).")

    draft_size = draft_vocab_size(options.draft_vocab, spec, options.draft_corpus) if with_mtp else None
    vocab = build_draft_vocab(checkpoint_dir, spec, draft_size, options.draft_corpus) if draft_size else None

    with StagingDir(out_dir, options.overwrite) as staging:
        store = _prepare_weights(spec, reader, options, with_mtp, vocab)
        with staging.create(WEIGHTS_FILE) as f:
            layout = store.write(f)
        builders = {(name, target): build for target in _targets(options)
                    for name, build in _graph_builders(spec, store, options.max_length, K, with_mtp, boundaries,
                                                       target, options.gdn_verify).items()}
        builders.update(_window_builders(spec, store, options.max_length, K, with_mtp, options.gdn_verify))
        if options.gdn_verify != "per_row" and CPU not in _targets(options):
            builders.update(_cpu_per_row_builders(spec, store, options.max_length, K, with_mtp, boundaries))
        if not options.sampling_graphs:
            builders = {key: build for key, build in builders.items() if not is_sampling_graph(key[0])}
        graphs = {}
        for (name, target), build in tqdm(builders.items(), desc="ortspec convert", unit="graph",
                                          disable=not options.progress):
            g = build()
            entry = {"file": graph_file(name, None if target == PORTABLE else target), "weights": g.used_weights}
            staging.write_bytes(entry["file"], g.build(layout).SerializeToString())
            _record(graphs, name, target, entry)
        tokenizer_files = [name for name in TOKENIZER_FILES if (checkpoint_dir / name).is_file()]
        for name in tokenizer_files:
            staging.copy(checkpoint_dir / name, name)
        manifest = Manifest.create(spec, max_length=options.max_length, num_speculative_tokens=K, dtype=options.dtype,
                                   weights=layout, graphs=graphs, tokenizer_files=tokenizer_files,
                                   source=str(checkpoint_dir), model_type=hf_config.get("model_type"),
                                   stage_layers=boundaries, quant=options.quant, files=staging.files,
                                   mtp_quant=options.head_quant if with_mtp else None, activations=options.activation_dtype,
                                   gdn_verify=options.gdn_verify,
                                   draft_vocab=vocab.manifest_entry() if vocab else None)
        staging.write_bytes(MANIFEST_FILE, manifest.to_json().encode(), record=False)
        staging.publish()
    return out_dir


def _path(name: str, value) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise ConvertOptionError(f"{name}={value!r} must be a path (str or pathlib.Path).")
    return Path(value)


def _prepare_weights(spec: ModelSpec, reader: CheckpointReader, options: ConvertOptions, with_mtp: bool,
                     vocab: DraftVocab | None) -> WeightStore:
    store = WeightStore()
    WeightPreparer(spec, reader, store).prepare_all(options.max_length, with_mtp)
    if vocab is not None:
        add_draft_head(store, vocab)
    if options.quant == "int4":
        quantize_store(store)
    elif options.head_quant == "int4" and with_mtp:
        quantize_draft_head(store)
    cast_matrices(store, options.dtype, options.activation_dtype)
    return store


def _targets(options: ConvertOptions) -> tuple[str, ...]:
    """The graph sets written: portable always; the CPU variants for float32 models (an fp16 or
    bf16 model is a GPU model: the CPU has no bfloat16 MatMul, QuickGelu's CPU kernel is float32)."""
    return (PORTABLE, CPU) if options.dtype == "float32" else (PORTABLE,)


def _graph_builders(spec: ModelSpec, store: WeightStore, max_length: int, K: int, with_mtp: bool,
                    boundaries: list[int], target: str = PORTABLE, gdn_verify: str = "per_row") -> dict:
    """Graph name -> a function building it for ``target`` (graphs are built one at a time, then
    written); the select verifies' GDN layers in the form gdn_verify (a CPU graph: per row)."""
    shapes = {"prefill": dict(rows=None), "decode": dict(rows=1),
              "decode_sample": dict(rows=1, choose=sampled_tokens(spec))}
    for k in range(1, K + 1):
        shapes[graph_name("verify", k)] = dict(rows=k + 1)
        shapes[graph_name("verify_select", k)] = dict(rows=k + 1, windows=True, gdn_verify=gdn_verify)
    builders = {}
    for name, shape in shapes.items():
        shape["target"] = target
        builders[name] = lambda name=name, shape=shape: make_target_graph(spec, store, max_length, name, **shape)
        if len(boundaries) > 2:
            for s, (start, stop) in enumerate(zip(boundaries, boundaries[1:])):
                builders[stage_graph_name(name, s)] = lambda name=name, shape=shape, s=s, r=range(start, stop): (
                    make_target_graph(spec, store, max_length, stage_graph_name(name, s), layers=r, stage=s, **shape))
    builders["sample_logits"] = lambda: make_sample_logits_graph(spec, store, target)
    if with_mtp:
        builders["mtp"] = lambda: make_mtp_graph(spec, store, max_length, target)
        for k in range(1, K + 1):
            builders[graph_name("mtp_propose", k)] = lambda k=k: make_mtp_propose_graph(spec, store, max_length, k,
                                                                                       target=target)
            builders[graph_name("mtp_sample", k)] = lambda k=k: make_mtp_propose_graph(spec, store, max_length, k,
                                                                                      sample=True, target=target)
            builders[graph_name("verify_mtp", k)] = lambda k=k: make_verify_mtp_graph(spec, store, max_length, k,
                                                                                       target=target,
                                                                                       gdn_verify=gdn_verify)
            builders[graph_name("verify_mtp_sample", k)] = lambda k=k: make_verify_mtp_sample_graph(
                spec, store, max_length, k, target=target, gdn_verify=gdn_verify)
    return builders


def _cpu_per_row_builders(spec: ModelSpec, store: WeightStore, max_length: int, K: int, with_mtp: bool,
                          boundaries: list[int]) -> dict:
    """(verify name, CPU) -> the portable graph with per-row GDN windows: the CPU variant of a model
    whose CUDA verifies take another form and that has no CPU graphs of its own (float16/bfloat16).
    A CPU Session then runs what it ran before the forms existed: the states of its verify rows are
    bitwise its decode's (a transition replay on the host rounds apart, ~1e-7)."""
    return {(name, CPU): build for name, build in _graph_builders(spec, store, max_length, K, with_mtp, boundaries,
                                                                 PORTABLE, "per_row").items()
            if has_state_windows(name) and not runs_on_gpus_only(name)}


def is_sampling_graph(name: str) -> bool:
    """decode_sample, sample_logits, verify_mtp_sample_k{k}, their tempered forms (decode_tempered,
    verify_mtp_tempered_k{k}: models converted before ortspec's sampling ops have them) and
    their variants: what sampling_graphs=False leaves out."""
    base = split_window_name(name)[0].split(".stage")[0]
    return base in ("decode_sample", "decode_tempered", "sample_logits") or base.startswith(
        ("verify_mtp_sample", "verify_mtp_tempered"))


def _window_builders(spec: ModelSpec, store: WeightStore, max_length: int, K: int, with_mtp: bool,
                     gdn_verify: str = "per_row") -> dict:
    """(window name, PORTABLE) -> a function building that KV window variant (converter/kv_windows.py):
    each graph that gets variants, built for W slots, then narrowed from the full caches; for
    every W of ``window_buckets(max_length)`` (none at max_length <= 256)."""
    builders = {}
    for slots in window_buckets(max_length):
        for name, build in _graph_builders(spec, store, slots, K, with_mtp, [0, spec.num_layers],
                                           gdn_verify=gdn_verify).items():
            if has_window_variants(name):
                builders[(window_graph_name(name, slots), PORTABLE)] = (
                    lambda build=build, slots=slots: narrow_to_window(build(), slots, max_length))
    return builders


def _record(graphs: dict, name: str, target: str, entry: dict) -> None:
    """Puts a written graph's entry into the manifest's graphs: a portable graph under its name,
    a provider variant under graphs[name][target], a window variant under
    graphs[name]["windows"][W] (the portable entries come first: _targets, _window_builders)."""
    graph, slots = split_window_name(name)
    if slots is not None:
        graphs[graph].setdefault("windows", {})[str(slots)] = entry
    elif target == PORTABLE:
        graphs[name] = entry
    else:
        graphs[name][target] = entry


def _stage_boundaries(num_layers: int, stages: int, stage_layers) -> list[int]:
    if stage_layers is not None:
        bounds = list(stage_layers)
        if not bounds or bounds[0] != 0 or bounds[-1] != num_layers or any(b > c for b, c in zip(bounds, bounds[1:])):
            raise ConvertOptionError(f"stage_layers={bounds} must rise from 0 to num_layers={num_layers}.")
        return bounds
    if not 1 <= stages <= num_layers:
        raise ConvertOptionError(f"pipeline_stages={stages} must be between 1 and the {num_layers} layers.")
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
