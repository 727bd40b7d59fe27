"""The engine in a process of its own, so that the HTTP side's Python never takes the engine's GIL.

Every streamed token costs the HTTP side Python (its text, its JSON, its socket write); in one
process that work and the engine's step bookkeeping take turns on one interpreter lock, and
on a GPU, whose step is shorter than both together, the GPU waits for them. ``ortspec serve``
therefore runs the Session and the engine thread (engine.py) in a child process (spawned,
never forked) and keeps uvicorn, the routes, the tokenizer and the detokenizer here.

One pipe carries both ways: jobs (checked token ids, ready to admit), cancels and stop go
down; each engine turn's events (engine.Tokens / Finished / Failed, keyed by job) come up in
one message (admissions' first tokens in one of their own, before the turn's step), with the
Session's stats every STATS_S. A sender thread in the child writes
them, so a slow reader never stalls a step. ``EngineProcess`` has the Engine's interface
(submit, cancel, start, stop, error, metrics, queue_depth, running), and answers a queue
over max_queue with QueueFull here, before anything crosses. While the server's event loop
runs, the loop reads the pipe itself (read_on .. read_off: a reader callback delivers each
event straight into its handler's queue); before and after, and while a dead child is
replaced, a reader thread does.

If the child dies (a crash in native code, the OOM killer), its requests fail with 500, /health
answers 503 while a new child loads the model, and serving goes on; a child that cannot load
the model stops the restarts (the error stays on /health).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import signal
import threading
import time

from .engine import Engine, Failed, Finished, Job, Metrics, QueueFull, Tokens, Unavailable, internal_error, refusal

STATS_S = 0.25  # how often the child sends its Session's stats (for /metrics)
HANDOVER_S = 0.1  # the most the reader thread takes to hand the pipe to a loop (read_on)
log = logging.getLogger("ortspec.serve")


@dataclasses.dataclass(frozen=True)
class Ready:
    """What the child reports once its Session is open."""

    reserved: int  # positions of max_length a request may not use (exact mode)
    k: int
    auto_k: bool
    stats: dict


class Front:
    """What the HTTP side reads of the model (a Session's names): the prompt side, the totals."""

    def __init__(self, prompts, engine: "EngineProcess") -> None:
        self.prompts, self.engine = prompts, engine
        self.manifest = prompts.manifest

    @property
    def tokenizer(self):
        return self.prompts.tokenizer

    def new_requests(self, *args, **kwargs):
        return self.prompts.new_requests(*args, **kwargs)

    @property
    def stats(self) -> dict:
        return self.engine.stats


class EngineProcess:
    """The Engine's interface over a child process (module docstring). Jobs are keyed here; a key
    is waiting from its submit to its first event (the parent's queue count) and known until its
    last (Finished or Failed); the Metrics are counted from the events as they arrive, the
    Session's stats come from the child every STATS_S."""

    def __init__(self, model_dir, session_options: dict, max_batch_size: int, max_queue: int,
                 log_level: str = "warning") -> None:
        self.model_dir, self.session_options, self.log_level = model_dir, dict(session_options), log_level
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.metrics = Metrics()
        self.error: str | None = None  # set while no child serves (it died, or cannot load the model)
        self.stats: dict = {}
        self.ready: Ready | None = None
        self._lock = threading.Lock()  # the job tables and the pipe's sending end
        self._jobs: dict[int, Job] = {}  # key -> job, until its last event
        self._key_of: dict[Job, int] = {}
        self._waiting: set[int] = set()  # keys without an event yet: queued in the child
        self._next_key = 0
        self._stopping = False
        self._conn = self._process = None
        self._reading = threading.Lock()  # who reads the pipe: the reader thread, or _loop's callback on _fd
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the pipe while it runs
        self._fd: int | None = None  # the pipe's end the loop watches, while it does
        self._reader: threading.Thread | None = None  # the last reader thread

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> Ready:
        """Spawns the child and waits until its Session is open (idempotent); raises the error
        the child's Session raised (a bad model directory, provider or option)."""
        if self.ready is None:
            self.ready = self._spawn()
            self._read_in_thread()
        return self.ready

    def read_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """(on loop's thread, as it starts) The loop reads the pipe from now on: the reader thread
        hands it over within HANDOVER_S."""
        with self._reading:
            self._loop = loop

    def read_off(self) -> None:
        """(on the loop's thread, as it ends) A reader thread reads the pipe again."""
        with self._reading:
            loop, self._loop = self._loop, None
            if self._fd is not None:  # else the thread still reads, or a _watch queued on the loop starts one
                loop.remove_reader(self._fd)
                self._fd = None
                self._read_in_thread()

    def submit(self, *jobs: Job) -> None:
        """Sends the jobs (a request's choices) to the child, all of them or none."""
        with self._lock:
            refused = refusal(self._stopping, self.error, self.max_queue, len(self._waiting), len(jobs), self.running)
            if refused is not None:
                raise self.metrics.refused(refused, len(jobs))
            keys = list(range(self._next_key, self._next_key + len(jobs)))
            try:
                self._conn.send(("submit", [(key, dataclasses.replace(job, deliver=None)) for key, job in zip(keys, jobs)]))
            except OSError:  # the child died a moment ago: the reader has not seen it yet
                raise self.metrics.refused(Unavailable("the engine process exited; a new one is loading the model: "
                                                       "retry shortly."), len(jobs)) from None
            self._next_key += len(jobs)
            for key, job in zip(keys, jobs):
                self._jobs[key], self._key_of[job] = job, key
                self._waiting.add(key)

    def cancel(self, job: Job) -> None:
        """The client went away: the child ends the job at its engine's next turn."""
        with self._lock:
            key = self._key_of.get(job)
            if key is not None and not self._stopping:
                try:
                    self._conn.send(("cancel", key))
                except OSError:  # the child is gone: its jobs fail with it
                    pass

    def stop(self) -> None:
        """The child fails waiting and running jobs with 503, closes its Session and exits."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            if self._conn is not None:
                try:
                    self._conn.send(("stop",))
                except OSError:  # the child is gone already
                    pass
        if self._process is not None:
            self._process.join(timeout=60)
            if self._process.is_alive():
                self._process.kill()
        self._fail_all(503, "the server is shutting down")  # a child killed, or gone, before it answered them

    def _fail_all(self, status: int, message: str | None = None) -> None:
        """Every job the child was given ends with this failure (message None: the 500 naming its id)."""
        self._fail(self._take_all(), status, message)

    def _take_all(self) -> list[Job]:
        """Every job the child was given, forgotten here."""
        with self._lock:
            jobs, self._jobs, self._key_of, self._waiting = list(self._jobs.values()), {}, {}, set()
        return jobs

    def _fail(self, jobs: list[Job], status: int, message: str | None = None) -> None:
        for job in jobs:
            self.metrics.finished[status] += 1
            job.deliver(Failed(status, message or internal_error(job.id)))

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Jobs sent to the child that have had an event and not their last."""
        return len(self._jobs) - len(self._waiting)

    # -- the reader thread --------------------------------------------------------------------
    def _spawn(self) -> Ready:
        context = multiprocessing.get_context("spawn")  # never fork: ONNX Runtime's and CUDA's threads
        here, there = context.Pipe()
        process = context.Process(target=child_main, name="ortspec-engine", daemon=True,
                                  args=(self.model_dir, self.session_options, self.max_batch_size, self.max_queue, there,
                                        self.log_level))
        process.start()
        there.close()
        try:
            first = here.recv()
        except EOFError:
            process.join()
            raise RuntimeError(f"the engine process exited (code {process.exitcode}) before it opened the model") from None
        if isinstance(first, BaseException):
            process.join()
            raise first
        self._conn, self._process, self.stats = here, process, first.stats
        return first

    def _read_in_thread(self, dead: bool = False) -> None:
        self._reader = threading.Thread(target=self._read, args=(dead,), name="ortspec-engine-reader", daemon=True)
        self._reader.start()

    def _read(self, dead: bool) -> None:
        """(the reader thread) Reads until a loop takes the pipe over, replacing a dead child
        (dead: the loop saw this one die) first."""
        while True:
            if dead:
                if self._stopping or not self._restart():
                    return
                dead = False
            with self._reading:
                if self._loop is not None and not self._stopping and self._hand_over(self._loop):
                    return
            try:
                if self._conn.poll(HANDOVER_S):
                    self._take(self._conn.recv())
            except (EOFError, OSError):
                dead = True

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> bool:
        try:
            loop.call_soon_threadsafe(self._watch, loop)
        except RuntimeError:  # the loop has closed without read_off: this thread goes on reading
            self._loop = None
            return False
        return True

    # -- the loop, between read_on and read_off ------------------------------------------------
    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._reading:
            if self._loop is loop and not self._stopping:
                self._fd = self._conn.fileno()
                loop.add_reader(self._fd, self._readable)
            else:  # read_off or stop came first
                self._read_in_thread()

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                self._take(self._conn.recv())
        except (EOFError, OSError):  # the child died (or stopped): a thread replaces it, then hands back
            with self._reading:
                self._loop.remove_reader(self._fd)
                self._fd = None
                self._read_in_thread(dead=True)

    # -- the reader: the thread or the loop ----------------------------------------------------
    def _take(self, message: dict) -> None:
        if "stats" in message:
            self.stats = message["stats"]
        if message.get("error"):
            self.error = message["error"]
        tokens = 0
        for key, event in message["events"]:
            with self._lock:
                job = self._jobs.get(key)
                if job is None:
                    continue
                if key in self._waiting:
                    self._waiting.discard(key)
                    if isinstance(event, Tokens):
                        self.metrics.admitted += 1
                        self.metrics.prompt_tokens += len(job.prompt)
                last = isinstance(event, (Finished, Failed))
                if last:
                    del self._jobs[key], self._key_of[job]
            if isinstance(event, Tokens):
                tokens += len(event.ids)
            elif last:
                self.metrics.finished[event.reason if isinstance(event, Finished) else event.status] += 1
            if not (isinstance(event, Finished) and event.reason == "cancelled"):  # nobody listens
                job.deliver(event)
        if tokens:
            self.metrics.record_step(tokens, time.monotonic())

    def _restart(self) -> bool:
        """(the child died) Fails its jobs with 500, then spawns a new one; False if that fails."""
        self._process.join(timeout=5)
        code = self._process.exitcode
        self.error = f"the engine process exited (code {code}); a new one is loading the model"
        jobs = self._take_all()  # their 500s name their ids, and the log names them here
        log.error("the engine process exited (code %s); failing its requests %s with 500 and starting a new one", code,
                  ", ".join(dict.fromkeys(job.id for job in jobs)) or "(none)")
        self._fail(jobs, 500)
        try:
            ready = self._spawn()
        except Exception as exc:  # noqa: BLE001  (reported on /health; nothing is served)
            log.exception("the new engine process failed")
            self.error = f"the engine process exited and a new one failed: {type(exc).__name__}: {exc}"
            return False
        self.ready, self.error = ready, None
        return True


# -- the child process ----------------------------------------------------------------------------
class Outbox:
    """The child's events, sent after each engine turn (and after admissions: first tokens) by a
    thread of their own (a slow reader never stalls a step), with the Session's stats every STATS_S."""

    def __init__(self, conn, session, engine_error) -> None:
        self.conn, self.session, self.engine_error = conn, session, engine_error
        self._turn: list[tuple[int, object]] = []  # this turn's events so far
        self._out: list[tuple[int, object]] = []  # whole turns' events, for the next message
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._send_all, name="ortspec-outbox", daemon=True)

    def start(self) -> None:
        """Sending begins (after the child's first message, Ready)."""
        self._thread.start()

    def poster(self, key: int):
        return lambda event: self.post(key, event)

    def post(self, key: int, event) -> None:
        with self._wake:
            self._turn.append((key, event))

    def flush(self) -> None:
        """(the engine's flush: after admissions and after each turn) The events so far go out."""
        with self._wake:
            if self._turn:
                self._out += self._turn
                self._turn = []
                self._wake.notify()

    def close(self) -> None:
        """Sends what is left, then the sender stops."""
        self.flush()
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _send_all(self) -> None:
        next_stats = 0.0
        while True:
            with self._wake:
                if not (self._out or self._closing):
                    self._wake.wait(max(0.0, next_stats - time.monotonic()))
                events, self._out, closing = self._out, [], self._closing
            message, now = {"events": events}, time.monotonic()
            if now >= next_stats or closing:
                message.update(stats=self.session.stats, error=self.engine_error())
                next_stats = now + STATS_S
            elif not events:
                continue
            try:
                self.conn.send(message)
            except OSError:  # the parent is gone
                return
            if closing:
                return


def child_main(model_dir, session_options: dict, max_batch_size: int, max_queue: int, conn,
               log_level: str = "warning") -> None:
    """The child: a Session and its engine thread, driven by the parent's messages until "stop"
    (or until the parent is gone). Its log lines (a failed turn's traceback) go to the stderr it
    shares with the parent, at the server's level and in its format."""
    from ..session import Session
    from .logs import log_to_stderr

    log_to_stderr(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    try:
        session = Session(model_dir, **session_options)
    except BaseException as exc:  # noqa: BLE001  (the parent raises it)
        conn.send(exc if _pickles(exc) else RuntimeError(f"{type(exc).__name__}: {exc}"))
        return
    engine: Engine | None = None
    outbox = Outbox(conn, session, lambda: engine.error if engine else None)
    engine = Engine(session, max_batch_size, max_queue, flush=outbox.flush)
    jobs: dict[int, Job] = {}

    def deliver_to(key: int):
        post = outbox.poster(key)

        def deliver(event) -> None:
            if isinstance(event, (Finished, Failed)):
                jobs.pop(key, None)
            post(event)

        return deliver

    try:
        engine.start()
        if engine.error:  # its batcher did not open
            conn.send(RuntimeError(f"the engine did not start: {engine.error}"))
            return
        conn.send(Ready(session.exact.k if session.exact else 0, session.k, session.auto_k, session.stats))
        outbox.start()
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if message[0] == "submit":
                made = [dataclasses.replace(job, deliver=deliver_to(key)) for key, job in message[1]]
                jobs.update({key: job for (key, _), job in zip(message[1], made)})
                try:
                    engine.submit(*made)
                except QueueFull as exc:  # the engine failed, or (a race the parent's count misses) full
                    for job in made:
                        job.deliver(Failed(503 if engine.error else exc.status, str(exc)))
                    outbox.flush()
            elif message[0] == "cancel" and message[1] in jobs:
                engine.cancel(jobs[message[1]])
            elif message[0] == "stop":
                break
    finally:
        engine.stop()
        outbox.close()
        session.close()


def _pickles(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return False
    return True
