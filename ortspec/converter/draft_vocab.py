"""The draft vocabulary: the N tokens the MTP head scores (as FR-Spec's frequency-ranked draft
vocabulary, SGLang's speculative token map and EAGLE-3's draft vocabulary do).

Why: the head shares the target's lm_head, and at Qwen3.5's vocabulary (248,320 tokens, hidden
1024) that is 254M parameters, a third of a 0.8B decode's weights, read once per draft. With a
draft vocabulary the head's logits are those of N tokens only: ``mtp.draft_head`` [H, N] holds the
lm_head's columns of the tokens in ``draft_tokens`` int64 [N] (ascending ids, so an argmax tie
picks the lowest id, as over the full vocabulary), quantized like the head. The graphs map a
draft back to its full id (a Gather over ``draft_tokens``) and scatter a sampled draft's
distribution into the full vocabulary (0 outside the map: converter/graphs.py), so every
consumer still sees full ids and [B, k, V] distributions. The output stays exactly the target's:
the target verifies over the full vocabulary; a token outside the map is never drafted, so only
acceptance can change (speculative sampling stays exact with q = 0 there).

The ranking: with a corpus (``draft_corpus``), its tokens by frequency under the checkpoint's
tokenizer (ties and unseen tokens by id); without one, by id: a byte-level BPE vocabulary numbers
its tokens in merge order after the byte alphabet, and its first merges join the pairs most
frequent in the tokenizer's own training text, so a lower id is a more frequent token (the merge
rank as a proxy for frequency). Either way the map holds the eos ids and the tokenizer's special
tokens (a chat turn ends on one), whatever their rank.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import ConvertOptionError
from ..model_spec import ModelSpec

DRAFT_TOKENS = "draft_tokens"  # int64 [N]: full-vocabulary id of each draft-vocabulary token, ascending
DRAFT_HEAD = "mtp.draft_head"  # [H, N]: the lm_head's columns of those tokens
AUTO_SIZE = 32768  # draft_vocab="auto": the N for a vocabulary of at least AUTO_MIN_VOCAB tokens
AUTO_MIN_VOCAB = 2 * AUTO_SIZE  # below it "auto" is off (the trained 20M model's 4,096 tokens: nothing to gain)
_ENCODE_LINES = 4096  # corpus lines per encode_batch call


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    tokens: np.ndarray  # int64 [N], ascending full-vocabulary ids
    source: str  # how the tokens were ranked (the manifest records it)

    def manifest_entry(self) -> dict:
        return {"size": int(self.tokens.size), "source": self.source, "tensor": DRAFT_TOKENS}


def draft_vocab_size(requested, spec: ModelSpec, corpus) -> int | None:
    """N for convert's draft_vocab (already type-checked: "auto", None, or an int >= 0), or None
    for none. A forced N must be below the vocabulary (else ConvertOptionError); "auto" is
    AUTO_SIZE from AUTO_MIN_VOCAB tokens up and off below, where a corpus given is ignored (said)."""
    V = spec.vocab_size
    if requested == "auto":
        if V >= AUTO_MIN_VOCAB:
            return AUTO_SIZE
        if corpus is not None:
            print(f"ortspec convert: draft_corpus {corpus} ignored: with a vocabulary of {V:,} tokens the draft "
                  f"vocabulary is off by default (it pays from {AUTO_MIN_VOCAB:,}); --draft-vocab N forces one.")
        return None
    if not requested:
        return None
    if requested >= V:
        raise ConvertOptionError(
            f"draft_vocab={requested} is not below the model's vocabulary of {V:,} tokens, so the draft head would "
            f"score every token anyway. Give a smaller N (e.g. {max(1, V // 4)}), or 0 for none.")
    return requested


def build_draft_vocab(checkpoint_dir: Path, spec: ModelSpec, size: int, corpus=None) -> DraftVocab:
    """The `size` tokens to draft from: the eos ids and special tokens, then the most frequent
    (module docstring); checkpoint_dir's tokenizer.json reads the corpus."""
    tokenizer = _tokenizer(checkpoint_dir, corpus)
    V = spec.vocab_size
    kept = sorted({i for i in spec.eos_token_ids if 0 <= i < V} | _special_ids(tokenizer, V))
    if len(kept) > size:
        raise ConvertOptionError(f"draft_vocab={size} cannot hold the model's {len(kept)} eos and special tokens; "
                                 f"give at least {len(kept)}.")
    counts = np.zeros(V, np.int64) if corpus is None else _corpus_counts(tokenizer, Path(corpus), V)
    ranked = np.lexsort((np.arange(V), -counts))  # most frequent first, ties (and unseen tokens) by id
    chosen = np.zeros(V, bool)
    chosen[kept] = True
    chosen[ranked[~chosen[ranked]][: size - len(kept)]] = True
    if corpus is not None:
        source = f"corpus {Path(corpus).name}: {int(counts.sum()):,} tokens"
    else:
        source = "id order (the tokenizer's merge rank)" if tokenizer is not None else "id order (no tokenizer)"
    return DraftVocab(np.flatnonzero(chosen).astype(np.int64), source)


def add_draft_head(store, vocab: DraftVocab) -> None:
    """draft_tokens and mtp.draft_head [H, N] (the lm_head's columns of the map) into the store,
    before any quantization or cast (converter/quantize.py and weights.cast_matrices treat the
    head as they treat the head's other matrices)."""
    store.add(DRAFT_TOKENS, vocab.tokens)
    store.add(DRAFT_HEAD, store.arrays["lm_head"][:, vocab.tokens])


def _tokenizer(checkpoint_dir: Path, corpus):
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        if corpus is not None:
            raise ConvertOptionError(f"draft_corpus {corpus} needs the checkpoint's tokenizer.json to count tokens, "
                                     f"and {checkpoint_dir} has none; leave draft_corpus out (tokens by id).")
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _special_ids(tokenizer, vocab: int) -> set[int]:
    if tokenizer is None:
        return set()
    return {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special and 0 <= i < vocab}


def _corpus_counts(tokenizer, corpus: Path, vocab: int) -> np.ndarray:
    """Occurrences of each token id in the corpus text, int64 [V]."""
    try:
        lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertOptionError(f"draft_corpus {corpus}: cannot read it as UTF-8 text ({exc}).") from exc
    counts = np.zeros(vocab, np.int64)
    for start in range(0, len(lines), _ENCODE_LINES):
        encoded = tokenizer.encode_batch(lines[start: start + _ENCODE_LINES], add_special_tokens=False)
        ids = np.fromiter((i for e in encoded for i in e.ids), np.int64)
        counts += np.bincount(ids[ids < vocab], minlength=vocab)
    if not counts.any():
        raise ConvertOptionError(f"draft_corpus {corpus} holds no text; give a file of the text the model will see.")
    return counts
