"""Continuous batching: requests join and leave a running batch between steps.

    with session.batcher(max_batch_size=4) as batcher:
        a = batcher.add_request([1, 2, 3], max_new_tokens=32)
        batcher.step()                       # {request id: its tokens not reported before}
        b = batcher.add_request([4, 5], max_new_tokens=8, temperature=0.7, seed=1)   # joins while `a` runs
        while batcher.pending:
            batcher.step()
        batcher.result(a), batcher.result(b)

A new request is prefilled into a free row when it is added (which makes its first token) and
takes part from the next step on (``add_requests(wait=False)``: where the prefill runs on a thread
of its own, from the step after it is done); a finished or cancelled request's row is freed for the next
arrival. step() reports every token exactly once, the first included, so the tokens a client
collects from step() are result(). Every request's tokens equal what it gets decoded alone
(with the same seed when it samples). On CUDA a step runs the rows from 0 up to the last running
request's, rounded up to a CUDA-graph batch bucket (one contiguous range at fixed addresses, so
the captured graphs keep replaying; new requests take the lowest free rows): a free row among
them holds a finished placeholder whose results are dropped. In exact mode too, and its engine has whole groups of
exact_batch_size rows: rows past max_batch_size hold placeholders for good.

A batcher holds one engine (state buffers for max_batch_size rows) from its creation until
``close()`` (or the end of its with block; or, unclosed, when it is garbage-collected), so a
generate call or another batcher of the same size never touches its states. It uses the
Session's public API only: ``lease_engine``, ``new_requests``, ``record_stats``, ``graphs``,
``k``, ``commit``, ``exact`` and ``prefill_thread``.

One thread at a time: add_request, step and cancel raise ConcurrentUseError while another
thread is inside one of them (close() waits for it instead). add_request is atomic: every
argument is checked before a row is touched, and if the prefill fails nothing of the request
remains (no id, its row as it was).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

from .. import validation
from ..errors import ClosedError, ConcurrentUseError, InputError
from ..runtime.graph_slots import batch_bucket
from .decoder import Decoder
from .k_policy import KScript
from .logprobs import TokenLogprob
from .requests import Request
from .stats import Stats


class Batcher:
    def __init__(self, session, max_batch_size: int = 8, **decoder_options) -> None:
        max_batch_size = validation.max_batch_size(max_batch_size)
        decoder_options = validation.decoder_options(decoder_options, "batcher")
        rows = session.exact.rows_for(max_batch_size) if session.exact else max_batch_size
        validation.batch_fits_memory(rows, session.manifest.states, session.graphs.arrays.device)
        self.session, self.max_batch_size = session, max_batch_size
        self.requests: dict[int, Request] = {}
        self._reported: dict[int, int] = {}  # request id -> output tokens step() has returned
        self._next_id = 0
        self._in_use = threading.RLock()  # held by the thread inside a call (re-entrant: a callback's own calls)
        self._recording = True  # calls add their counters to the Session's stats (not warm_up's)
        self.decoder: Decoder | None = None
        lease = session.lease_engine(rows)
        self._give_back = weakref.finalize(self, lease.release)  # at close(), or when dropped unclosed
        self._lease = lease
        try:
            with self._call() as engine:
                if session.prefill_thread is not None:  # the Session's choice, unless the call makes its own
                    decoder_options.setdefault("background_prefill", session.prefill_thread)
                self.decoder = Decoder(session.graphs, rows, session.k, session.commit, Stats(), engine=engine,
                                       exact=session.exact, k_chooser=session.k_chooser, **decoder_options)
                if self.decoder.fixed_rows:  # every row must hold a sequence: finished placeholders
                    self.decoder.admit([Request.filler(row) for row in range(rows)])
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drops the step in flight, then gives the engine back (idempotent), after the call another
        thread has in flight. add_request, step and cancel then raise ClosedError; result and
        pending still answer."""
        with self._in_use:
            if not self.closed and self.decoder is not None:
                try:
                    with self._call():
                        self.decoder.close()
                except ClosedError:  # the Session closed first: nothing to read out
                    pass
            self._give_back()

    @property
    def closed(self) -> bool:
        return not self._give_back.alive

    @contextlib.contextmanager
    def _call(self):
        """One call on the engine: refused once closed or while another thread is inside one,
        waited for by Session.close(); its counters go to the Session's totals when it ends."""
        with self._one_thread():
            with self._lease.using() as engine:
                try:
                    yield engine
                finally:
                    if self.decoder is not None:
                        if self._recording:
                            self.session.record_stats(self.decoder.stats)  # and zeroes them
                        else:
                            self.decoder.stats.clear()

    @contextlib.contextmanager
    def _one_thread(self):
        if not self._in_use.acquire(blocking=False):
            raise ConcurrentUseError("this batcher is in a call from another thread; a batcher serves one thread at "
                                     "a time (its rows share one engine): open one batcher per thread, or serialize "
                                     "the calls with a lock.")
        try:
            if self.closed:
                raise ClosedError("this batcher is closed; open a new one with session.batcher(...).")
            yield
        finally:
            self._in_use.release()

    @property
    def rows(self) -> list[Request | None]:
        """The engine's rows (the loop's occupants): requests take the first max_batch_size."""
        return self.decoder.occupants

    @property
    def pending(self) -> list[int]:
        """Ids of the requests step() still owes tokens: running, or finished with tokens it has
        not returned yet (a request can finish at its prefill). ``while batcher.pending:
        batcher.step()`` therefore delivers every token."""
        return [rid for rid, r in self.requests.items() if not r.done or self._unreported(rid)]

    @property
    def running(self) -> list[int]:
        """Ids of the requests still generating (each holds a row)."""
        return [rid for rid, r in self.requests.items() if not r.done]

    def _unreported(self, rid: int) -> bool:
        return self.requests[rid].output_length > self._reported[rid]

    def add_request(self, prompt, max_new_tokens: int = 32, stop_tokens=None, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop=None,
                    logprobs: int | None = None, seed_index: int = 0, min_p: float = 0.0, **unknown) -> int:
        """Validates and prefills one prompt into a free row; returns the request id.

        prompt: token ids (as for Session.generate), or a str, encoded with the model's
        tokenizer; step() and result() return token ids either way (session.tokenizer.decode
        turns them into text). max_new_tokens >= 1; stop_tokens, stop (strings) and the sampling
        arguments (temperature, top_k, top_p, min_p, seed) as for generate: with the same seed a request
        gets the tokens generate(prompt, seed=seed) gets, and with seed_index i those that prompt
        i of generate([...], seed=seed) gets. logprobs N (0..20): each token's log-probability
        under the model (the log-softmax of the target's logits) and the N most probable
        alternatives, read with logprobs(id); such a request's steps keep the logits on the host."""
        arguments = dict(locals())
        del arguments["self"], arguments["unknown"]
        if unknown:  # an InputError naming the keywords, as generate() gives, not Python's TypeError
            raise InputError(validation.unknown_keyword(next(iter(unknown)), "add_request"))
        return self.add_requests([arguments])[0]

    def add_requests(self, requests: list[dict], wait: bool = True) -> list[int]:
        """Several add_request calls in one, all or none: each dict holds add_request's keyword
        arguments; returns their ids. Requests of one prompt (an API request's n choices) are
        prefilled once: the others' rows start from copies of its states, and each draws its own
        first token from the same logits.

        wait=False: returns once the prefills are under way where the engine runs them on a thread
        of their own (CUDA: a prefill's Run holds the host for milliseconds, and the steps go on
        meanwhile), else once they are done. The requests take part from the step after their
        prefill is done, which reports their first tokens; a prefill that fails there ends its
        requests with finish_reason "error" (``error(id)`` says why) and the batch goes on."""
        with self._call():
            new = [self._checked(**arguments) for arguments in validation.request_arguments(requests)]
            joining = self.decoder.joining_rows
            free = [i for i, r in enumerate(self.rows[: self.max_batch_size])
                    if (r is None or r.done) and i not in joining]  # finished: free
            if len(free) < len(new):
                taken = (f"all {self.max_batch_size} rows are busy" if not free else
                         f"{len(free)} of {self.max_batch_size} rows are free, for {len(new)} requests")
                raise InputError(f"{taken}; call step() until a request finishes, or open a batcher with a larger "
                                 "max_batch_size.")
            previous = {row: self.rows[row] for row in free[: len(new)]}
            for req, row in zip(new, free):
                req.row = row
            try:
                if wait:
                    self.decoder.admit(new)
                else:
                    self.decoder.submit(new, guard=self._lease.using)
            except BaseException:  # atomic: the rows as they were, no ids; their next requests prefill them anew
                for row, occupant in previous.items():
                    self.rows[row] = occupant
                raise
            ids = list(range(self._next_id, self._next_id + len(new)))
            self._next_id += len(new)
            for rid, req in zip(ids, new):
                self.requests[rid], self._reported[rid] = req, 0
            return ids

    def _checked(self, prompt, max_new_tokens: int = 32, stop_tokens=None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop=None, logprobs: int | None = None,
                 seed_index: int = 0, min_p: float = 0.0) -> Request:
        """One request of add_request's arguments, every one checked; no row touched."""
        params = validation.sampling(temperature, top_k, top_p, seed, min_p)
        validation.sampling_graphs(self.session.manifest, self.session.k, params, self.session.auto_k)
        new = self.session.new_requests(prompt, max_new_tokens, stop_tokens, min_new_tokens=1, sampling=params,
                                        stop=stop, logprobs=logprobs, seed_index=seed_index)
        validation.single_prompt([r.prompt for r in new.requests], new.single)
        return new.requests[0]

    def step(self) -> dict[int, list[int]]:
        """One decoding step for every running request (none when no request runs); returns, for
        every request that was running or had unreported tokens, the tokens not returned before:
        a new request's first token (made when it was added) comes with its first step."""
        with self._call():
            owed = self.pending
            self.decoder.step()
            return self._report(owed)

    def report(self) -> dict[int, list[int]]:
        """What step() would report now, without a step: the first tokens of requests added since
        (their prefill made them), and what finished requests still owe. A server sends a new
        request's first token with this, a step sooner."""
        with self._one_thread():
            return self._report(self.pending)

    def _report(self, owed: list[int]) -> dict[int, list[int]]:
        report = {}
        for rid in owed:
            report[rid] = self.requests[rid].output(self._reported[rid])
            self._reported[rid] += len(report[rid])
        return report

    WARM_UP = (dict(), dict(temperature=1.0, seed=0), dict(temperature=1.0, top_p=0.9, seed=0))  # greedy, sampled

    def warm_up(self) -> None:
        """Steps of each graph a server's requests may run, before they arrive: every k and, with
        auto k, every switch between neighbouring k (``KScript.warm_up``), greedy, sampled and
        sampled with top-p, over one-token prompts. Where steps run fixed rows (CUDA) at each
        CUDA-graph batch bucket up to max_batch_size (a capture takes tens of milliseconds, a step
        a fraction of one); else, and in exact mode (its steps all run one shape), in one row (on
        the CPU a graph's session is made at its first use, 0.2-0.6 s, and its first run prepacks
        the weights, whatever the rows). Leaves no request behind, nothing in the Session's stats
        and nothing in auto k's measurements."""
        session = self.session
        script = KScript.warm_up(session.k, session.auto_k).ks  # each pass steps it from its start
        sizes = {min(batch_bucket(n), self.max_batch_size) for n in range(1, self.max_batch_size + 1)} \
            if self.decoder.fixed_rows and not session.exact else {1}  # exact mode: every step at one shape
        room = session.manifest.max_length - session.manifest.num_speculative_tokens - 2  # exact mode reserves K
        tokens = max(4, min(len(script) * (session.k + 1), room))  # the script through
        self._recording = False
        try:
            for size, sampling in itertools.product(sorted(sizes), self.WARM_UP):
                with self.decoder.scripted_k(KScript(script)):
                    ids = self.add_requests([dict(prompt=[0], max_new_tokens=tokens, stop_tokens=[], **sampling)] * size)
                    while self.pending:
                        self.step()
                for rid in ids:
                    self.forget(rid)
            if session.k_chooser is not None:
                session.k_chooser.warmed_up(None if session.exact else sizes)  # exact mode: one shape, any rows
        finally:
            self._recording = True

    def cancel(self, request_id: int) -> None:
        """Stops a request now (a client went away): its row is free for the next add_request,
        result() keeps its tokens so far, step() reports nothing more of it. A finished request
        is left as it is."""
        with self._one_thread():
            req = self._request(request_id)
            req.cancel()
            self._reported[request_id] = req.output_length

    def forget(self, request_id: int) -> None:
        """Drops a finished request whose tokens step() has all reported (its id is then unknown): a
        long-running batcher (a server's) would otherwise keep every request it ever ran, and walk
        them all at each step."""
        req = self._request(request_id)
        if not req.done or self._unreported(request_id):
            raise InputError(f"request {request_id} is {'running' if not req.done else 'owed tokens by step()'}; "
                             "forget it once it is done and step() has reported all its tokens.")
        del self.requests[request_id], self._reported[request_id]

    def finish_reason(self, request_id: int) -> str | None:
        """None while the request runs; then "stop" (a stop token or string), "length" (max_new_tokens),
        "cancelled" or "error" (its prefill failed: ``error``)."""
        return self._request(request_id).finish_reason

    def error(self, request_id: int) -> BaseException | None:
        """Why the request's prefill failed (finish_reason "error"), else None."""
        return self._request(request_id).error

    def result(self, request_id: int) -> list[int]:
        """The request's tokens so far (all of them once it is done)."""
        return self._request(request_id).output()

    def logprobs(self, request_id: int, start: int = 0) -> list[TokenLogprob]:
        """The log-probabilities of result(request_id)[start:], for a request added with logprobs."""
        req = self._request(request_id)
        if req.logprobs is None:
            raise InputError(f"request {request_id} was added without logprobs; add_request(..., logprobs=N) keeps "
                             "them.")
        return req.output_logprobs(validation.integer("start", start, InputError, 0))

    def _request(self, request_id: int) -> Request:
        request_id = validation.request_id(request_id)
        if request_id not in self.requests:
            raise InputError(f"no request with id {request_id}; ids come from add_request.")
        return self.requests[request_id]


def run_arrivals(batcher: Batcher, requests: list[tuple[list[int], int]], every: int = 2,
                 wait: bool = True) -> list[list[int]]:
    """Feeds (prompt, max_new_tokens) requests into a running batch, one every `every` steps
    while a row is free, steps until all are done, and returns their tokens in request order.
    A staggered-arrival driver for tests and benchmarks; wait: add_requests'."""
    queue, ids, step = list(requests), [], 0
    while queue or batcher.pending:
        if queue and step % every == 0 and len(batcher.running) < batcher.max_batch_size:
            prompt, n = queue.pop(0)
            ids.extend(batcher.add_requests([dict(prompt=prompt, max_new_tokens=n)], wait=wait))
        if batcher.pending:
            batcher.step()
        step += 1
    return [batcher.result(i) for i in ids]
