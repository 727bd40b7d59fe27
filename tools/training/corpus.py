"""Corpus (Python sources on this machine, split by path) and its byte-level BPE tokenizer."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EOS = "<|endoftext|>"  # id 0: document separator and eos
VOCAB_SIZE = 4096
HELD_OUT_PER_MILLE = 30  # sha1(path) % 1000 < 30 -> held-out test split (~3%)


@dataclass
class Corpus:
    train: list[str]
    test: list[str]
    train_files: int
    test_files: int
    skipped_files: int
    sources: list[str]


def is_held_out(rel_path: str) -> bool:
    """Deterministic ~3% split by a hash of the path relative to its source root."""
    return int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:8], "big") % 1000 < HELD_OUT_PER_MILLE


def python_files(root: Path, *, skip_site_packages: bool) -> list[tuple[str, Path]]:
    """(relative path, path) of every *.py under root, sorted by relative path."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if skip_site_packages and ({"site-packages", "dist-packages"} & set(rel.parts)):
            continue
        if path.is_file():
            files.append((rel.as_posix(), path))
    return sorted(files)


def read_corpus(max_bytes: int, *, site_packages: bool = False) -> Corpus:
    """The stdlib (+ purelib) Python sources up to max_bytes, split into train and test."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    if site_packages:
        roots.append(Path(sysconfig.get_paths()["purelib"]))
    corpus = Corpus([], [], 0, 0, 0, [str(r) for r in roots])
    total = 0
    for i, root in enumerate(roots):
        for rel, path in python_files(root, skip_site_packages=i == 0):
            if total >= max_bytes:
                return corpus
            try:
                text = path.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                corpus.skipped_files += 1
                continue
            if not text.strip():
                continue
            total += len(text.encode())
            if is_held_out(f"{i}/{rel}"):
                corpus.test.append(text)
                corpus.test_files += 1
            else:
                corpus.train.append(text)
                corpus.train_files += 1
    return corpus


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE, <|endoftext|> = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.token_to_id(EOS) != 0:
        raise RuntimeError(f"{EOS} got id {tokenizer.token_to_id(EOS)}, expected 0")
    return tokenizer


def write_tokenizer(tokenizer, out_dir: Path, model_max_length: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts encoded (in parallel) and joined as  doc0 <eos> doc1 <eos> ... : int32 [N]."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int32)
