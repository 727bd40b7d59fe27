"""``convert``'s arguments: types and ranges checked before any work, and the bounds that
max_length must respect for the model and for this machine.

Why max_length is bounded: the converter precomputes tables sized by it (RoPE cos/sin in
weights.bin, a position constant in every graph) and a Session allocates, per request, a KV
cache of max_length rows for every full-attention layer and for the MTP head. Unbounded,
max_length=10**9 got the process OOM-killed instead of an error.
"""

from __future__ import annotations

import dataclasses
import numbers
import os

from ..errors import ConvertOptionError
from ..manifest import GDN_VERIFY_FORMS, MAX_SPECULATIVE_TOKENS, MAX_STATE_WINDOW, state_bytes, state_table
from ..model_spec import FULL, ModelSpec
from ..validation import machine_memory_bytes

DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("auto", "float32", "model")  # the dtype between layers: auto (the model's unless int4), float32, the model's
QUANTS = (None, "int4")
HEAD_QUANTS = ("auto", "int4", "none", None)  # mtp_quant: auto (int4 for a float32 model), int4, none (None: none)
GRAPHS_PER_SESSION = 4  # prefill, decode, verify, mtp_propose: each holds its own position constant [L] int64


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """convert()'s keyword arguments, each of the right type and in range (else ConvertOptionError)."""

    num_speculative_tokens: int = 4
    dtype: str = "float32"
    max_length: int = 1024
    pipeline_stages: int = 1
    stage_layers: tuple[int, ...] | None = None
    quant: str | None = None
    mtp_quant: str | None = "auto"
    activations: str = "auto"
    gdn_verify: str = "auto"
    draft_vocab: int | str | None = "auto"
    draft_corpus: str | None = None
    sampling_graphs: bool = True
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "max_length", "pipeline_stages"):
            object.__setattr__(self, name, _integer(name, getattr(self, name)))
        if self.stage_layers is not None:
            if isinstance(self.stage_layers, (str, bytes)) or not isinstance(self.stage_layers, (list, tuple)):
                raise ConvertOptionError(f"stage_layers={self.stage_layers!r} must be a list of layer indices such "
                                         "as [0, 2, 4], or None for an even split.")
            object.__setattr__(self, "stage_layers", tuple(_integer("stage_layers", b) for b in self.stage_layers))
        for name in ("sampling_graphs", "overwrite", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ConvertOptionError(f"{name}={getattr(self, name)!r} must be True or False.")
        self._check_ranges()

    def _check_ranges(self) -> None:
        if self.quant not in QUANTS:
            raise ConvertOptionError(f"quant={self.quant!r} is not supported; use 'int4' or leave it out.")
        if self.mtp_quant not in HEAD_QUANTS:
            raise ConvertOptionError(f"mtp_quant={self.mtp_quant!r} is not supported; use 'auto' (the default: "
                                     "int4 for a float32 model), 'int4' or 'none'.")
        if self.dtype not in DTYPES:
            raise ConvertOptionError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
        self._check_activations()
        self._check_draft_vocab()
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConvertOptionError(f"num_speculative_tokens={self.num_speculative_tokens} is out of range; "
                                     f"use 0..{MAX_SPECULATIVE_TOKENS}.")
        if self.max_length < 2:
            raise ConvertOptionError(f"max_length={self.max_length} is too small; use at least 2 "
                                     "(typical: 1024-8192).")
        if self.pipeline_stages < 1:
            raise ConvertOptionError(f"pipeline_stages={self.pipeline_stages} must be at least 1.")
        self._check_gdn_verify()

    def _check_gdn_verify(self) -> None:
        if self.gdn_verify == "auto":  # the GPU's dtypes get the measured fastest form; float32 keeps the CPU's
            object.__setattr__(self, "gdn_verify", "per_row" if self.dtype == "float32" else "transition")
        if not isinstance(self.gdn_verify, str) or self.gdn_verify not in GDN_VERIFY_FORMS:
            raise ConvertOptionError(f"gdn_verify={self.gdn_verify!r} is not supported; use one of "
                                     f"{', '.join(map(repr, GDN_VERIFY_FORMS))} (manifest.GDN_VERIFY_FORMS says how "
                                     "each form's CUDA verify emits the GDN states).")
        if self.gdn_verify == "state_window" and self.num_speculative_tokens + 1 > MAX_STATE_WINDOW:
            raise ConvertOptionError(
                f"gdn_verify='state_window' with num_speculative_tokens={self.num_speculative_tokens}: the ops' "
                f"state_window holds at most {MAX_STATE_WINDOW} rows, a verify of k={self.num_speculative_tokens} "
                f"has {self.num_speculative_tokens + 1}. Use num_speculative_tokens <= {MAX_STATE_WINDOW - 1}, "
                "or gdn_verify='transition'.")


    def _check_activations(self) -> None:
        if not isinstance(self.activations, str) or self.activations not in ACTIVATIONS:
            raise ConvertOptionError(
                f"activations={self.activations!r} is not supported; use 'auto' (the default: the model's "
                "float16/bfloat16 between layers, float32 with float32 or int4 weights), 'model' or 'float32'.")
        if self.activations == "model" and self._int4():
            raise ConvertOptionError(
                f"activations='model' with {' and '.join(self._int4())} is not supported: int4 products "
                "(MatMulNBits) take float32 activations here, so every one would gain a Cast pair. Use "
                "activations='auto' (the default) or 'float32' with int4 weights.")

    def _check_draft_vocab(self) -> None:
        """draft_vocab: "auto", None or 0 (none), or a token count N >= 1 (its bound, the model's
        vocabulary, is checked with the model: draft_vocab.draft_vocab_size); draft_corpus a file."""
        value = self.draft_vocab
        if value != "auto" and value is not None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ConvertOptionError(f"draft_vocab={value!r} is not supported; use 'auto' (the default: "
                                         "32768 tokens for a vocabulary from 65536 up, none below), a token count "
                                         "N such as 32768, or 0 for none.")
            object.__setattr__(self, "draft_vocab", int(value))
        if self.draft_corpus is not None:
            if not isinstance(self.draft_corpus, (str, os.PathLike)) or not os.path.isfile(self.draft_corpus):
                raise ConvertOptionError(f"draft_corpus={self.draft_corpus!r} is not a file; give a text file whose "
                                         "token frequencies rank the draft vocabulary, or leave it out.")
            if self.draft_vocab in (0, None):
                raise ConvertOptionError(f"draft_corpus={self.draft_corpus!r} ranks a draft vocabulary, but "
                                         f"draft_vocab={self.draft_vocab!r} asks for none; give draft_vocab "
                                         "('auto' or N) or leave draft_corpus out.")

    def _int4(self) -> list[str]:
        return [f"{name}='int4'" for name in ("quant", "mtp_quant") if getattr(self, name) == "int4"]

    @property
    def head_quant(self) -> str | None:
        """The MTP draft head's weights: "int4" (MatMulNBits, blocks of 32) or None (the model's
        dtype). mtp_quant="auto" quantizes a float32 model's head: drafts are only proposals, so
        the output stays the target's, and on the CPU a draft pass costs about a third for nearly
        the same acceptance (docs/history.md). A float16/bfloat16 model is a GPU
        model whose products and activations stay in its dtype: its head does too."""
        if self.quant == "int4" or self.mtp_quant == "int4":
            return "int4"
        return "int4" if self.mtp_quant == "auto" and self.dtype == "float32" else None

    @property
    def activation_dtype(self) -> str:
        """The dtype between layers: the model's with activations="model", and with "auto" unless
        int4 weights need float32 ones; else float32 (a float32 model's is float32 either way: the
        same graphs). On the H200 the model's float16 between layers made greedy 8-9% faster (51
        Casts per decode of the 20M model became 17), with speculative == greedy in float32,
        float16 and bfloat16 (BENCHMARKS.md)."""
        wanted = self.activations == "model" or (self.activations == "auto" and not self._int4())
        return self.dtype if wanted else "float32"


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConvertOptionError(f"{name}={value!r} must be an integer, not {type(value).__name__}"
                                 f"{' (pass it without quotes)' if isinstance(value, str) else ''}.")
    return int(value)


def check_max_length(spec: ModelSpec, max_length: int, with_mtp: bool, memory: int | None = None) -> None:
    """Refuses a max_length beyond the model's max_position_embeddings, or one whose per-request
    state buffers and tables exceed this machine's memory (memory: bytes, default: measured)."""
    limit = spec.max_position_embeddings
    if limit is not None and max_length > limit:
        raise ConvertOptionError(
            f"max_length={max_length} exceeds max_position_embeddings={limit} in config.json: the model was not "
            f"made for positions beyond it. Use --max-length {limit} or less.")
    memory = machine_memory_bytes() if memory is None else memory
    need = request_bytes(spec, max_length, with_mtp)
    if memory is None or need <= memory:
        return
    fixed = request_bytes(spec, 0, with_mtp)
    fits = (memory - fixed) // (request_bytes(spec, 1, with_mtp) - fixed)
    caches = len(spec.layers_of(FULL)) + with_mtp
    raise ConvertOptionError(
        f"max_length={max_length} needs {_gib(need)} for one request's state buffers and tables (the KV caches "
        f"of {caches} attention layer{'s' if caches != 1 else ''}{' incl. the MTP head' if with_mtp else ''}, the "
        f"GDN states, RoPE tables and position constants), but this machine has {_gib(memory)} of memory. "
        f"Use --max-length {fits} or less.")


def request_bytes(spec: ModelSpec, max_length: int, with_mtp: bool) -> int:
    """Bytes of one request's state buffers (fp32, manifest.state_table) plus the tables sized by
    max_length: RoPE cos/sin [L, rotary/2] fp32 and the position constant [L] int64 of each graph."""
    states = state_bytes(state_table(spec, max_length, with_mtp))
    tables = 2 * 4 * max_length * (spec.rotary_dim // 2) + GRAPHS_PER_SESSION * 8 * max_length
    return states + tables


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
