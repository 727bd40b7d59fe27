"""``ortspec.Session``: the public API."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from . import validation
from .errors import ClosedError, ConfigurationError
from ._native_loader import load_native
from .manifest import Manifest, graph_name, stage_graph_name
from .runtime.engines import Engine, EnginePool, Lease
from .runtime.graph_slots import batch_bucket
from .runtime.graphs import GraphSet, check_provider
from .speculative.auto_k import KChooser
from .speculative.commits import COMMITS
from .speculative.decoder import Decoder
from .speculative.step_kinds import fusable_ks
from .speculative.requests import Request
from .speculative.sampling import GREEDY, SamplingParams, random_stream
from .speculative.stats import Stats, StatsTotals
from .prompts import NewRequests, Prompts
from .stop_strings import StopStrings


class Session:
    """Greedy and MTP-speculative generation over a converted model directory.

    >>> s = ortspec.Session("out/tiny", num_speculative_tokens=2)
    >>> s.generate([1, 2, 3], max_new_tokens=8)          # list[int] -> list[int]
    >>> s.generate([[1, 2], [3, 4, 5]], max_new_tokens=8)  # batch -> list of lists
    >>> s.generate("def main(", max_new_tokens=8)          # str -> str (needs tokenizer.json)

    num_speculative_tokens k: 0 = plain greedy; 1..K (K chosen at conversion) = MTP drafts
    per step; "auto" = the Session chooses k in 0..K for each step, the one with the most
    tokens per second by its measured step times and acceptance (``speculative.auto_k``;
    its estimates: ``stats["auto_k"]``). commit: "select" (keep the verify's state after the accepted row) or
    "readvance" (restore the pre-verify state and re-run the accepted tokens). Output is
    token-identical to greedy either way (bitwise on the CPU; on a GPU in float32 - see the
    README for float16/bfloat16). exact=True runs every step's target forward at one fixed
    shape, exact_batch_size rows x (exact_k + 1) tokens (exact_k: default the conversion's K),
    so that on a GPU in float16/bfloat16 too a token's bits depend on neither the batch, nor
    its row, nor k (``runtime.forward_shapes``); it reserves exact_k positions of max_length
    and runs exact_k + 1 rows per request per step (on the CPU the default is exact already).
    threads: intra-op threads per graph session, None (or 0) for ONNX Runtime's default; more
    than the cores this process may use (os.sched_getaffinity) is refused with a
    ConfigurationError, not clamped. prefill_thread: whether a batcher's add_requests(wait=False)
    (the server's) runs each prefill on a thread of its own while the running requests go on
    (None: on CUDA, where the GPU runs one thing at a time; on the CPU the two Runs then share
    the cores). Every option is checked (ortspec.validation) before any graph session is built.

    Threads: every running generate call and every open batcher holds its own state buffers
    (an engine, leased per batch size from a pool: ``runtime.engines``), so a Session may be
    used from several threads. At most max_engines_per_batch_size engines exist per batch size;
    a caller beyond that waits for one to be given back, and is refused (EnginesHeldError)
    where its own thread holds them all. On the CPU calls on different engines run in
    parallel; on CUDA their steps take turns. ``close()`` (or ``with Session(...) as s:``)
    releases engines, captured CUDA graphs, sessions and device memory.
    """

    def __init__(self, model_dir: str | Path, provider: str = "cpu", num_speculative_tokens: int | str = 0,
                 commit: str = "select", threads: int | None = None, cuda_graphs: bool = True,
                 pipeline_stages: int = 1, devices: list[int] | None = None,
                 max_engines_per_batch_size: int = 4, exact: bool = False, exact_batch_size: int = 16,
                 exact_k: int | None = None, prefill_thread: bool | None = None, **unknown) -> None:
        if unknown:  # a ConfigurationError naming the options (Session(d, k=2)), not Python's TypeError
            raise ConfigurationError(validation.unknown_keyword(next(iter(unknown)), "Session"))
        self.manifest = Manifest.load(validation.model_dir(model_dir))
        check_provider(validation.provider(provider))
        self.stages = validation.pipeline_stages(pipeline_stages, self.manifest)
        cuda_count = load_native().build_info()["cuda_device_count"] if provider == "cuda" and devices is not None else None
        self.devices = validation.devices(devices, self.stages, cuda_count)
        self.auto_k = isinstance(num_speculative_tokens, str) and num_speculative_tokens == validation.AUTO_K
        self.k = validation.num_speculative_tokens(num_speculative_tokens, self.manifest)  # auto: the most per step
        if self.auto_k and exact and exact_k is not None:
            self.k = min(self.k, exact_k)
        self.commit = validation.commit(commit, tuple(COMMITS))
        self.exact = validation.exact_shape(exact, exact_batch_size, exact_k, self.k, self.manifest)
        self.prompts = Prompts(self.manifest, self.exact.k if self.exact else 0)
        self.k_chooser = KChooser(self.k) if self.auto_k else None  # shared by every call and batcher
        validation.model_dtype(self.manifest, provider)
        threads, cuda_graphs = validation.threads(threads), validation.cuda_graphs(cuda_graphs)
        self.prefill_thread = validation.prefill_thread(prefill_thread)
        max_engines_per_batch_size = validation.max_engines_per_batch_size(max_engines_per_batch_size)
        self.graphs = GraphSet(self.manifest, provider, threads, cuda_graphs=cuda_graphs, devices=self.devices)
        self.graphs.load(self._graph_names())
        make_engine = functools.partial(Engine.create, self.graphs, k=self.k, stages=self.stages)  # batch -> Engine
        self._engines = EnginePool(make_engine, max_engines_per_batch_size)  # (no reference back to the Session)
        self._totals = StatsTotals()

    def _graph_names(self) -> list[str]:
        """The graphs this Session's calls run: prefill, then exact mode's one fixed graph, or
        decode and the commit's verify graph; the MTP head's (auto k: every k's); and the verify
        with the head inside where a step may run it (select, one stage, converted with it)."""
        ks = list(range(1, self.k + 1)) if self.auto_k else [self.k] if self.k else []
        if self.exact:
            names = ["prefill", self.exact.graph]
        else:
            names = ["prefill", "decode"] + [graph_name(COMMITS[self.commit].verify_graph, k) for k in ks]
        names = [g for name in names for g in ([name] if self.stages == 1 else
                                                [stage_graph_name(name, s) for s in range(self.stages)])]
        fused = fusable_ks(self.manifest, self.commit, self.exact is not None, self.stages)
        return names + [graph_name("mtp_propose", k) for k in ks] + [graph_name("verify_mtp", k) for k in ks if k in fused]

    # -- public ------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Totals over every finished call (and every batcher step so far), per-slot CUDA-graph
        counters, and per batch size the engines made, leased now and callers waiting."""
        stats = self._totals.snapshot().as_dict()
        stats["graphs"] = self.graphs.graph_counters()
        stats["engines"] = self._engines.census()
        if self.k_chooser is not None:
            stats["auto_k"] = self.k_chooser.snapshot()
        return stats

    def reset_stats(self) -> None:
        self._totals.reset()

    def record_stats(self, stats: Stats) -> None:
        """Adds one call's counters to the totals that ``stats`` reports and zeroes them (thread-safe);
        a batcher calls it after each of its calls."""
        self._totals.add(stats)

    @property
    def tokenizer(self):
        return self.prompts.tokenizer

    def generate(self, prompt, max_new_tokens: int = 32, stop_tokens=None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | list[int] | None = None, stream: bool = False,
                 stop=None, min_p: float = 0.0, **decoder_options):
        """Greedy (or exact speculative) continuation of one prompt or a batch of prompts.

        prompt: token ids (list or tuple of ints or numpy integers, 1-D numpy integer array)
        -> list[int]; a batch (list of those, 2-D numpy integer array) -> list[list[int]];
        str -> str; list[str] -> list[str]. Exactly max_new_tokens tokens per request, unless a
        stop token (default: the model's eos ids; stop_tokens: one id or a list of ids, [] for
        none) ends it earlier, stop token included. stop: a string or a list of strings (needs
        the model's tokenizer), matched on the generated text across token boundaries: a request
        ends at the token that completes one (tokens up to it are returned; text ends before it).

        temperature 0 (the default) is greedy; > 0 samples from softmax(logits / temperature),
        cut to the top_k most likely tokens (0: all), then to the smallest set whose
        probability reaches top_p (1: all), then to the tokens at least min_p times as probable
        as the most probable one (0: all). With k > 0 the drafts are accepted by exact
        speculative sampling, so tokens follow that same distribution. seed (an int) makes the
        tokens reproducible for this k (a batch's prompt i gets stream i of the seed; prompt 0
        is what a single prompt gets); a list of ints, one per prompt: prompt i gets stream 0
        of seed[i], the tokens generate(prompt_i, seed=seed[i]) and a batcher's (or the
        server's) request with that seed get; None draws fresh entropy.

        stream=True (one prompt) returns an iterator instead: token ids (or, for a text prompt,
        text pieces that never split a character) as each step commits them; joined, they equal
        what stream=False returns. The state buffers are held until it is exhausted or closed.
        Session.close() from another thread waits only for the step in flight, not for the
        iterator's end: the iterator's next step then raises ClosedError.

        decoder_options: the Decoder's hooks make_drafts, on_commit, fixed_rows, pipelined,
        fused_verify (tests, exactness tools, A/B runs: pipelined=False keeps the host in step
        with the GPU, fused_verify=False runs the MTP head in a Run of its own); any other
        keyword is an InputError. Every argument is checked before
        any work starts.
        """
        options = validation.decoder_options(decoder_options, "generate")
        per_prompt = validation.per_prompt_seeds(seed)
        params = validation.sampling(temperature, top_k, top_p, None if per_prompt else seed, min_p)
        validation.sampling_graphs(self.manifest, self.k, params, self.auto_k)
        stream = validation.flag("stream", stream)
        new = self.new_requests(prompt, max_new_tokens, stop_tokens, sampling=params, stop=stop)
        if per_prompt:
            for req, own in zip(new.requests, validation.seeds(seed, len(new.requests))):
                req.sampling = dataclasses.replace(params, seed=own)
                req.random = random_stream(req.sampling, 0)
        self._check_open()
        if stream:
            validation.single_prompt([r.prompt for r in new.requests], new.single, "generate(..., stream=True)",
                                     "for many streams use session.batcher(): step() returns each request's new tokens")
            return self._stream(new.requests[0], new.text, options)
        outs = self._generate_requests(new.requests, options)
        if new.text:
            outs = [r.stop_strings.text if r.stop_strings else self.tokenizer.decode(o)
                    for r, o in zip(new.requests, outs)]
        return outs[0] if new.single else outs

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

    def new_requests(self, prompt, max_new_tokens: int = 32, stop_tokens=None, min_new_tokens: int = 0,
                     sampling: SamplingParams = GREEDY, stop=None, logprobs: int | None = None,
                     seed_index: int = 0) -> NewRequests:
        """Checked requests for any prompt form generate takes: ``Prompts.new_requests``."""
        return self.prompts.new_requests(prompt, max_new_tokens, stop_tokens, min_new_tokens, sampling, stop, logprobs,
                                         seed_index)

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
    def _generate_requests(self, requests: list[Request], decoder_options) -> list[list[int]]:
        if requests[0].max_new_tokens == 0:
            return [[] for _ in requests]
        for _ in self._decode(requests, decoder_options):
            pass
        return [r.output() for r in requests]

    def _stream(self, req: Request, text: bool, decoder_options):
        """Yields the request's tokens (text pieces for a text prompt) as each step commits them;
        text that could be the start of a stop string waits until it is known not to be."""
        pieces = (req.stop_strings or StopStrings(self.tokenizer)) if text else None  # the request's reads its tokens
        sent = 0
        for _ in self._decode([req], decoder_options, per_step=True) if req.max_new_tokens else ():
            new, sent = req.output(sent), req.output_length
            if pieces is None:
                yield from new
                continue
            if new and pieces is not req.stop_strings:
                pieces.add(new)
            if piece := pieces.take():
                yield piece
        if pieces is not None:
            pieces.finish()
            if rest := pieces.take():
                yield rest

    def _decode(self, requests: list[Request], decoder_options, per_step: bool = False):
        """Leases an engine for the requests (padded with placeholders to ``_engine_rows``),
        prefills and steps them, yielding after the prefill and after each step. The engine and
        the call's counters go back when the generator ends, fails or is closed. per_step (a
        stream, whose consumer may pause between steps for as long as it likes): the engine is
        marked in use (``Lease.using``, what Session.close() waits for) during each step only,
        so close() waits at most one step and the next step raises ClosedError."""
        self._check_open()
        rows = self._engine_rows(len(requests))
        validation.batch_fits_memory(rows, self.manifest.states, self.graphs.arrays.device)
        requests = requests + [Request.filler(i) for i in range(len(requests), rows)]  # placeholders: padding rows
        stats = Stats()
        lease = self.lease_engine(rows)
        try:
            with lease.using() as engine:
                decoder = Decoder(self.graphs, rows, self.k, self.commit, stats, engine=engine, exact=self.exact,
                                  k_chooser=self.k_chooser, **decoder_options)
                steps = decoder.steps(requests)
                if not per_step:
                    yield from steps
                    return
            yield from _one_use_per_step(lease, steps)
        finally:
            self.record_stats(stats)
            lease.release()

    def _engine_rows(self, requests: int) -> int:
        """The rows a generate call of this many requests runs: whole groups of exact_batch_size in
        exact mode; the CUDA-graph batch bucket on CUDA; else one per request."""
        if self.exact:
            return self.exact.rows_for(requests)
        return batch_bucket(requests) if self.graphs.arrays.device != "cpu" else requests

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"this Session of {self.manifest.dir} is closed (Session.close()); open a new Session.")


_DONE = object()


def _one_use_per_step(lease: Lease, steps):
    """Runs the generator ``steps`` one step per ``lease.using()``, yielding between them outside
    it; the first step after Session.close() revoked the lease raises ClosedError."""
    try:
        while True:
            with lease.using():
                if next(steps, _DONE) is _DONE:
                    return
            yield
    finally:
        try:
            with lease.using():
                steps.close()
        except ClosedError:  # revoked: the loops' ends (pipelined.drain) free only their own buffers
            steps.close()
