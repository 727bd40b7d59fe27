"""``ortspec.Session``: the public API."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from .errors import ClosedError, ConfigurationError, InputError
from ._native_loader import load_native
from .manifest import Manifest, graph_name, stage_graph_name
from .runtime.engines import Engine, EnginePool, Lease
from .runtime.graph_slots import batch_bucket
from .runtime.graphs import GraphSet, check_provider
from .speculative.decoder import COMMITS, Decoder
from .speculative.requests import Request
from .speculative.stats import Stats, StatsTotals


class Session:
    """Greedy and MTP-speculative generation over a converted model directory.

    >>> s = ortspec.Session("out/tiny", num_speculative_tokens=2)
    >>> s.generate([1, 2, 3], max_new_tokens=8)          # list[int] -> list[int]
    >>> s.generate([[1, 2], [3, 4, 5]], max_new_tokens=8)  # batch -> list of lists
    >>> s.generate("def main(", max_new_tokens=8)          # str -> str (needs tokenizer.json)

    num_speculative_tokens k: 0 = plain greedy; 1..K (K chosen at conversion) = MTP drafts
    per step. commit: "select" (keep the verify's state after the accepted row) or
    "readvance" (restore the pre-verify state and re-run the accepted tokens). Output is
    token-identical to greedy either way.

    Threads: every running generate call and every open batcher holds its own state buffers
    (an engine, leased per batch size from a pool: ``runtime.engines``), so a Session may be
    used from several threads. At most max_engines_per_batch_size engines exist per batch size;
    a caller beyond that waits for one to be given back, and is refused (EnginesHeldError)
    where its own thread holds them all. On the CPU calls on different engines run in
    parallel; on CUDA their steps take turns. ``close()`` (or ``with Session(...) as s:``)
    releases engines, captured CUDA graphs, sessions and device memory.
    """

    def __init__(self, model_dir: str | Path, provider: str = "cpu", num_speculative_tokens: int = 0,
                 commit: str = "select", threads: int | None = None, cuda_graphs: bool = True,
                 pipeline_stages: int = 1, devices: list[int] | None = None,
                 max_engines_per_batch_size: int = 4) -> None:
        self.manifest = Manifest.load(model_dir)
        check_provider(provider)
        self.stages = self._check_stages(pipeline_stages)
        self.devices = self._check_devices(devices, provider)
        self.k = self._check_k(num_speculative_tokens)
        if commit not in COMMITS:
            raise ConfigurationError(f"commit={commit!r} is unknown; use one of {', '.join(map(repr, COMMITS))}.")
        self.commit = commit
        if self.manifest.dtype == "bfloat16" and provider != "cuda":
            raise ConfigurationError(
                f"{self.manifest.dir} was converted with dtype bfloat16, which runs on provider='cuda' only "
                "(ONNX Runtime's CPU has no bfloat16 MatMul); convert with --dtype float16 or float32 for the CPU."
            )
        if not isinstance(max_engines_per_batch_size, int) or max_engines_per_batch_size < 1:
            raise ConfigurationError(f"max_engines_per_batch_size={max_engines_per_batch_size!r} must be an integer "
                                     ">= 1 (state buffer sets per batch size that callers lease).")
        self.graphs = GraphSet(self.manifest, provider, threads, cuda_graphs=cuda_graphs, devices=self.devices)
        self.graphs.load(self._graph_names())
        make_engine = functools.partial(Engine.create, self.graphs, k=self.k, stages=self.stages)  # batch -> Engine
        self._engines = EnginePool(make_engine, max_engines_per_batch_size)  # (no reference back to the Session)
        self._totals = StatsTotals()
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()

    def _check_k(self, k) -> int:
        m = self.manifest
        if not isinstance(k, int) or k < 0:
            raise ConfigurationError(f"num_speculative_tokens={k!r} must be an integer >= 0.")
        if k > 0 and not m.has_mtp:
            raise ConfigurationError(
                f"num_speculative_tokens={k} needs an MTP head, but {m.dir} was converted from a checkpoint "
                "without mtp.* weights. Use num_speculative_tokens=0, or convert a checkpoint that has them."
            )
        if k > m.num_speculative_tokens:
            raise ConfigurationError(
                f"num_speculative_tokens={k} exceeds K={m.num_speculative_tokens} chosen at conversion; use "
                f"k <= {m.num_speculative_tokens} or reconvert with --num-speculative-tokens {k}."
            )
        return k

    def _check_stages(self, stages) -> int:
        available = self.manifest.num_stages
        if not isinstance(stages, int) or stages < 1:
            raise ConfigurationError(f"pipeline_stages={stages!r} must be an integer >= 1.")
        if stages > 1 and stages != available:
            raise ConfigurationError(
                f"pipeline_stages={stages}, but {self.manifest.dir} holds graphs for "
                f"{available if available > 1 else 'no'} pipeline stages; reconvert with --pipeline-stages {stages}."
            )
        return stages

    def _check_devices(self, devices, provider) -> list[int]:
        """One device per stage (default: all on device 0). On the CPU the names only place the
        stages' buffers apart (one host); on CUDA each must be a GPU of this machine."""
        if devices is None:
            return [0] * self.stages
        if not isinstance(devices, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in devices):
            raise ConfigurationError(f"devices={devices!r} must be a list of device indices (ints >= 0), one per stage.")
        if len(devices) != self.stages:
            raise ConfigurationError(
                f"devices={list(devices)} must name one device per pipeline stage ({self.stages}); "
                f"e.g. devices={list(range(self.stages))}."
            )
        if provider == "cuda":
            count = load_native().build_info()["cuda_device_count"]
            missing = [d for d in devices if d >= count]
            if missing:
                raise ConfigurationError(
                    f"devices={list(devices)} names cuda:{missing[0]}, but this machine has {count} CUDA "
                    f"device{'s' if count != 1 else ''}; use indices below {count}."
                )
        return list(devices)

    def _graph_names(self) -> list[str]:
        names = ["prefill", "decode"]
        if self.k:
            names += [graph_name("verify_select" if self.commit == "select" else "verify", self.k)]
        names = [g for name in names for g in ([name] if self.stages == 1 else
                                                [stage_graph_name(name, s) for s in range(self.stages)])]
        return names + ([graph_name("mtp_propose", self.k)] if self.k else [])

    # -- public ------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Totals over every finished call (and every batcher step so far), per-slot CUDA-graph
        counters, and per batch size the engines made, leased now and callers waiting."""
        stats = self._totals.snapshot().as_dict()
        stats["graphs"] = self.graphs.graph_counters()
        stats["engines"] = self._engines.census()
        return stats

    def reset_stats(self) -> None:
        self._totals.reset()

    def record_stats(self, stats: Stats) -> None:
        """Adds one call's counters to the totals that ``stats`` reports (thread-safe); a batcher
        calls it after each of its calls."""
        self._totals.add(stats)

    @property
    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                path = self.manifest.tokenizer_path
                if path is None:
                    raise InputError(
                        f"{self.manifest.dir} has no tokenizer.json, so text prompts cannot be encoded; "
                        "pass token ids (list[int]) or convert a checkpoint that ships tokenizer.json."
                    )
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def generate(self, prompt, max_new_tokens: int = 32, stop_tokens=None, **decoder_options):
        """Greedy (or exact speculative) continuation of one prompt or a batch of prompts.

        prompt: list[int] -> list[int]; list[list[int]] -> list[list[int]]; str -> str;
        list[str] -> list[str]. Exactly max_new_tokens tokens per request, unless a stop
        token (default: the model's eos ids) ends it earlier, stop token included.
        """
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            ids = [self.tokenizer.encode(t).ids for t in texts]
            outs = self._generate_ids(ids, max_new_tokens, stop_tokens, decoder_options)
            decoded = [self.tokenizer.decode(o) for o in outs]
            return decoded[0] if isinstance(prompt, str) else decoded
        single = isinstance(prompt, list) and (not prompt or not isinstance(prompt[0], (list, tuple)))
        prompts = [prompt] if single else prompt
        outs = self._generate_ids(prompts, max_new_tokens, stop_tokens, decoder_options)
        return outs[0] if single else outs

    def batcher(self, max_batch_size: int = 8, **decoder_options):
        """A running batch that requests join and leave between steps (add_request / step). It
        holds its state buffers until closed: ``with session.batcher(...) as b:`` or ``b.close()``."""
        from .speculative.batcher import Batcher

        self._check_open()
        return Batcher(self, max_batch_size, **decoder_options)

    def lease_engine(self, batch_size: int) -> Lease:
        """State buffers for batch_size rows, the caller's alone until ``lease.release()`` (or the
        end of ``with session.lease_engine(n) as engine:``). Policy: the Session class docstring.
        Kept across calls: on CUDA the captured graphs bind an engine's addresses, so the next
        call that leases it replays them."""
        return self._engines.lease(batch_size)

    def new_requests(self, prompts, max_new_tokens: int, stop_tokens=None) -> list[Request]:
        """Validated requests for token-id prompts, in rows 0..n-1, stopping at the model's eos ids
        unless stop_tokens is given. Raises InputError before any work starts."""
        prompts = self._check_prompts(prompts, max_new_tokens)
        stops = frozenset(self.manifest.spec.eos_token_ids if stop_tokens is None else stop_tokens)
        return [Request(row=i, prompt=p, max_new_tokens=max_new_tokens, stop_tokens=stops)
                for i, p in enumerate(prompts)]

    @property
    def closed(self) -> bool:
        return self.graphs.closed

    def close(self) -> None:
        """Waits for calls in flight (in any thread), closes open batchers, then releases the
        engines, the captured CUDA graphs and their static buffers, the ONNX Runtime sessions and
        device memory. Later calls raise ClosedError; ``stats`` still answers. Idempotent."""
        self._engines.close()
        self.graphs.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _generate_ids(self, prompts, max_new_tokens, stop_tokens, decoder_options) -> list[list[int]]:
        self._check_open()
        requests = self.new_requests(prompts, max_new_tokens, stop_tokens)
        if max_new_tokens == 0:
            return [[] for _ in requests]
        count = rows = len(requests)
        if self.graphs.arrays.device != "cpu":  # CUDA graphs per batch bucket: pad with placeholders
            rows = batch_bucket(rows)
            requests += [Request.filler(i) for i in range(len(requests), rows)]
        stats = Stats()
        with self.lease_engine(rows) as engine:
            decoder = Decoder(self.graphs, rows, self.k, self.commit, stats, engine=engine, **decoder_options)
            try:
                return decoder.generate(requests)[:count]
            finally:
                self.record_stats(stats)

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"this Session of {self.manifest.dir} is closed (Session.close()); open a new Session.")

    def _check_prompts(self, prompts, max_new_tokens) -> list[list[int]]:
        """Validates everything before any work starts, so a bad request leaves nothing half-done."""
        vocab, limit = self.manifest.spec.vocab_size, self.manifest.max_length
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InputError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0.")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError("generate needs a prompt: a list of token ids, a list of such lists, or a string.")
        checked = []
        for n, p in enumerate(prompts):
            where = f"prompt {n}" if len(prompts) > 1 else "the prompt"
            if not isinstance(p, (list, tuple)) or len(p) == 0:
                raise InputError(f"{where} is empty; give at least one token id.")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise InputError(f"{where} must hold Python ints (token ids); got {type(p[0]).__name__} values.")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise InputError(f"{where} has token id {bad[0]} outside the vocabulary [0, {vocab}); "
                                 "check that the tokenizer matches the model.")
            if len(p) + max_new_tokens > limit:
                raise InputError(
                    f"{where} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that is "
                    f"{len(p) + max_new_tokens} > max_length={limit} of this conversion. Shorten the prompt, "
                    f"lower max_new_tokens, or reconvert with --max-length {len(p) + max_new_tokens}."
                )
            checked.append([int(t) for t in p])
        return checked
