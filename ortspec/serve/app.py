"""The HTTP side (Starlette): OpenAI-compatible routes over the engine thread.

    GET  /health                 200 {"status": "ok"} (503 once the engine failed)
    GET  /metrics                Prometheus text: tokens/s, acceptance, queue depth, running requests, ...
    GET  /v1/models              the one model served
    GET  /openapi.json           the OpenAPI description of these routes (openapi.py)
    POST /v1/completions         prompt -> text, or server-sent events with "stream": true
    POST /v1/chat/completions    messages -> text, when the model directory has a chat template

A handler reads the body within the limits (limits.py: 413 over max_body_bytes, 408 past
body_timeout), then checks and tokenizes the request in a worker thread, never on the event
loop (400 on anything wrong, 404 for a model not served, 413 for a text over
max_prompt_chars, before it is tokenized), submits a Job per choice (429 when the queue is
full) and reads the jobs' events from an asyncio queue that the engine thread posts into,
into an ``Answer`` (answer.py: text cut at stop strings, logprobs, the bodies). A client that disconnects cancels its jobs, which frees their
rows at the engine's next turn: a waiting request's handler watches for the disconnect
(``_disconnected``), a stream's is cancelled by Starlette. A disconnect is one log line (INFO);
anything unexpected is a 500 naming the request's id, its traceback logged (ERROR) under it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import InputError
from . import openapi, protocol
from .answer import Answer
from .chat import ChatTemplate, TemplateError
from .engine import Engine, Failed, Job, QueueFull, Tokens, internal_error
from .limits import Limits, max_commas
from .logprobs import TokenTexts
from .metrics import prometheus_text

log = logging.getLogger("ortspec.serve")
INLINE_CHECK_BYTES = 4096  # bodies up to this size are checked on the event loop (Routes._check)


def error(status: int, message: str, close: bool = False, code: str | None = None,
          param: str | None = None) -> JSONResponse:
    """An OpenAI-style error body; close: end the connection after it (a body left unread)."""
    return JSONResponse(protocol.error_body(message, status, code, param), status_code=status,
                        headers={"Connection": "close"} if close else None)


class Routes:
    """model_name: the name /v1/models lists; a body's model may also be the directory's name."""

    def __init__(self, session, engine: Engine, model_name: str, limits: Limits,
                 chat_template: ChatTemplate | None) -> None:
        self.session, self.engine, self.model = session, engine, model_name
        self.names = tuple(dict.fromkeys([model_name, session.manifest.dir.name]))
        self.max_n = min(engine.max_batch_size, engine.max_queue)  # a request's choices are rows, queued together
        self.limits, self.chat_template = limits, chat_template
        self.max_length = session.manifest.max_length
        self.max_commas = max_commas(limits.max_prompt_chars, self.max_length)
        self.has_tokenizer = session.manifest.tokenizer_path is not None
        self.refused: collections.Counter = collections.Counter()  # HTTP status -> requests refused while checked
        self._mailbox_of: Mailbox | None = None
        self._texts: TokenTexts | None = None
        self.created = int(time.time())

    async def health(self, request: Request) -> Response:
        if self.engine.error:
            return JSONResponse({"status": "error", "error": self.engine.error}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus_text(self.engine, self.session.stats, self.refused),
                                 media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "ortspec"}]})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi.description(self.names, self.chat_template is not None, self.max_n))

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        if self.chat_template is None:
            return error(404, f"{self.session.manifest.dir} has no chat template (tokenizer_config.json "
                              "'chat_template'); use /v1/completions with a prompt.")
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        request_id = protocol.new_id()
        try:
            raw = await self._body(request)
            req, prompt = (self._check(raw, chat, request_id) if len(raw) <= INLINE_CHECK_BYTES else
                           await asyncio.to_thread(self._check, raw, chat, request_id))
        except protocol.HTTPError as exc:  # the rest of a body is not read past 408 and 413
            self.refused[exc.status] += 1
            return error(exc.status, str(exc), close=exc.status in (408, 413), code=exc.code, param=exc.param)
        except ClientDisconnect:
            log.info("request %s: the client disconnected before its body arrived", request_id)
            return Response(status_code=499)  # nobody reads it
        except Exception:  # noqa: BLE001
            log.exception("request %s failed while it was checked", request_id)
            return error(500, internal_error(request_id))
        events: asyncio.Queue = asyncio.Queue()  # (choice index, event)
        mailbox, deadline = self._mailbox(), time.monotonic() + req.timeout
        jobs = [Job(prompt, req.max_tokens, req.sampling, deadline, deliver=mailbox.poster(events, i), id=request_id,
                    stop=req.stop, logprobs=req.logprobs, seed_index=i, ignore_eos=req.ignore_eos)
                for i in range(req.n)]
        try:
            self.engine.submit(*jobs)
        except QueueFull as exc:
            return error(exc.status, str(exc))  # counted under it (Metrics.refused)
        answer = Answer(req, self.model, len(prompt), self.session.tokenizer if self.has_tokenizer else None,
                        self._token_texts(), self._echo(req, prompt))
        if req.stream:
            return StreamingResponse(self._events(answer, jobs, events), media_type="text/event-stream")
        return await self._whole(request, answer, jobs, events)

    def _token_texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.session.tokenizer if self.has_tokenizer else None)
        return self._texts

    def _echo(self, req, prompt: list[int]) -> str:
        """The prompt's text, where the request echoes it."""
        if not req.echo or not self.has_tokenizer:
            return ""
        return req.prompt if isinstance(req.prompt, str) else self.session.tokenizer.decode(prompt)

    def _cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.engine.cancel(job)

    def _mailbox(self) -> Mailbox:
        """The mailbox of the running event loop (one per loop: uvicorn runs one)."""
        loop = asyncio.get_running_loop()
        if self._mailbox_of is None or self._mailbox_of.loop is not loop:
            self._mailbox_of = Mailbox(loop)
        return self._mailbox_of

    async def _body(self, request: Request) -> bytes:
        """The whole body, or TooLarge (413) past max_body_bytes, BodyTimeout (408) past body_timeout."""
        limit, declared = self.limits.max_body_bytes, request.headers.get("content-length", "")
        too_large = f"bytes, more than this server takes ({limit}, --max-body-bytes); send a smaller request."
        if declared.isdigit() and int(declared) > limit:
            raise protocol.TooLarge(f"the body has {int(declared)} {too_large}")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise protocol.TooLarge(f"the body has more than {limit} {too_large}")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.limits.body_timeout)
        except asyncio.TimeoutError:
            raise protocol.BodyTimeout(f"the body did not arrive within {self.limits.body_timeout:g} s of its headers "
                                       "(--body-timeout); send it whole.") from None

    def _check(self, raw: bytes, chat: bool, request_id: str) -> tuple[protocol.Completion, list[int]]:
        """The checked request and its prompt's token ids. Parsing, the chat template and the
        tokenizer take time in proportion to the body, which the loop must not spend: a body over
        INLINE_CHECK_BYTES is checked in a worker thread, a smaller one on the loop (a hop to a
        thread and back costs a short request more than its check)."""
        commas = raw.count(b",")
        if commas > self.max_commas:
            raise protocol.TooLarge(f"the body holds {commas} commas, more JSON values than any request this model "
                                    f"takes ({self.max_commas}: max_length {self.max_length} token ids, or text of at "
                                    "most --max-prompt-chars characters); send a shorter prompt.")
        req = protocol.completion(protocol.parse_json(raw), chat, self.limits.request_timeout, request_id, self.names,
                                  self.max_n, self.max_length)
        self._check_tokenizer(req, chat)
        if chat:
            self._check_length(sum(len(m["content"]) for m in req.messages), "the messages' contents")
        elif isinstance(req.prompt, str):
            self._check_length(len(req.prompt), "the prompt")
        try:
            prompt = self.chat_template.render(req.messages) if chat else req.prompt
            if chat:  # the roles, other keys and the template's own text count too; the tokenizer holds the GIL
                self._check_length(len(prompt), "the chat prompt (the messages rendered with the model's template)")
            [checked] = self.session.new_requests(prompt, req.max_tokens, min_new_tokens=1, sampling=req.sampling,
                                                  stop=req.stop, logprobs=req.logprobs).requests
        except TemplateError as exc:
            raise protocol.BadRequest(str(exc)) from None
        except InputError as exc:  # the prompt's length with max_tokens, its ids, the stop strings' text
            raise protocol.refused(exc) from None
        return req, checked.prompt

    def _check_tokenizer(self, req: protocol.Completion, chat: bool) -> None:
        """A model without a tokenizer takes token ids only (the Python API's message names its types)."""
        if self.has_tokenizer:
            return
        model = f"this server's model ({self.session.manifest.dir.name}) has no tokenizer.json"
        if chat or isinstance(req.prompt, str):
            raise protocol.BadRequest(f"{model}, so text cannot be encoded; send /v1/completions a prompt of token ids: "
                                      "an array of integers such as [1, 2, 3].")
        if req.stop:
            raise protocol.BadRequest(f"{model}, so stop strings cannot be matched on the generated text; leave stop "
                                      "out (the model's end-of-text tokens and max_tokens still end a choice).")

    def _check_length(self, characters: int, what: str) -> None:
        limit = self.limits.max_prompt_chars
        if limit is not None and characters > limit:
            raise protocol.TooLarge(
                f"{what} has {characters} characters, more than this server takes ({limit}, --max-prompt-chars): "
                f"so long a text cannot fit the model's max_length={self.session.manifest.max_length} tokens. "
                "Shorten it.")

    async def _whole(self, request: Request, answer: Answer, jobs: list[Job], events: asyncio.Queue) -> Response:
        """Waits for every choice; a client gone meanwhile cancels them, a failed one the others."""
        watcher = asyncio.ensure_future(_disconnected(request, events))
        try:
            while not answer.finished:
                index, event = await events.get()
                if event is DISCONNECTED:
                    self._cancel(jobs)
                    log.info("request %s: the client disconnected; its request is cancelled", jobs[0].id)
                    return Response(status_code=499)  # nobody reads it
                if isinstance(event, Failed):
                    self._cancel(jobs)
                    return error(event.status, event.message)
                answer.take(index, event)
            return JSONResponse(answer.whole())
        finally:
            watcher.cancel()

    async def _events(self, answer: Answer, jobs: list[Job], events: asyncio.Queue):
        """Server-sent events as tokens commit; Starlette cancels this when the client goes away,
        and the jobs with it."""
        done = False
        try:
            for echoed in answer.echo_chunks():
                yield echoed
            while not answer.finished:
                index, event = _coalesced(await events.get(), events)
                if isinstance(event, Failed):
                    done = True
                    self._cancel(jobs)
                    yield _error_event(event.status, event.message)
                    return
                piece = answer.chunk(index, event)
                done = answer.finished  # every job has ended: none to cancel
                yield piece
            if answer.req.include_usage:
                yield answer.usage_chunk()
            yield protocol.DONE
        except Exception:  # noqa: BLE001  (the headers are out: the error goes as the last event)
            done = True
            self._cancel(jobs)
            log.exception("request %s failed while it streamed", jobs[0].id)
            yield _error_event(500, internal_error(jobs[0].id))
        finally:
            if not done:
                self._cancel(jobs)
                log.info("request %s: the client disconnected; its stream is cancelled", jobs[0].id)


DISCONNECTED = object()  # posted into a waiting request's events when its client goes away


async def _disconnected(request: Request, events: asyncio.Queue) -> None:
    """Posts DISCONNECTED once the client has gone (the body is read: receive() answers nothing else)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait((None, DISCONNECTED))


def _error_event(status: int, message: str) -> str:
    return f"data: {json.dumps(protocol.error_body(message, status))}\n\n"


class Mailbox:
    """Events from the engine thread into handlers' queues on one event loop. While events flow
    the loop collects them every POLL_S; only the first event after a quiet spell wakes it. A
    wake-up is a system call on the engine thread, which then waits for the GIL while the loop
    runs the handlers' Python: one per step serialised the two threads, where polling lets the
    loop's work overlap the engine's Runs (docs/serving.md). An event delivered on the loop
    itself (the engine process's pipe, read by the loop) goes straight into its queue."""

    # How often a busy loop collects the engine's events (about the most a token waits). Both loops
    # time in whole milliseconds: asyncio's selector rounds 0.5 ms up (it polled every 1.1 ms),
    # uvloop rounds it down to 0 (a poll every turn of the loop), so 1 ms: 1.1 ms on either.
    POLL_S = 0.001
    QUIET_POLLS = 8  # polls that found nothing before the loop waits for a wake-up again

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self._loop_thread = loop, threading.get_ident()  # made on the loop (Routes._mailbox)
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []
        self._polling = False  # a poll is scheduled: events need no wake-up
        self._quiet = 0

    def poster(self, events: asyncio.Queue, index: int = 0):
        """deliver(event) for the engine thread: (index, event) into this handler's queue, on the loop."""

        def deliver(event) -> None:
            with self._lock:
                if not self._pending and threading.get_ident() == self._loop_thread:  # no older event waits
                    events.put_nowait((index, event))
                    return
                self._pending.append((events, (index, event)))
                if self._polling or len(self._pending) > 1:
                    return  # a poll or a flush is already scheduled
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop has closed (the server stopped): nobody reads it any more
                pass

        return deliver

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._quiet = 0 if pending else self._quiet + 1
            self._polling = self._quiet < self.QUIET_POLLS
        for events, event in pending:
            events.put_nowait(event)
        if self._polling:
            self.loop.call_later(self.POLL_S, self._flush)


def _coalesced(item: tuple, events: asyncio.Queue) -> tuple:
    """A choice's Tokens event with its Tokens queued right behind it (a stream that fell behind
    sends one chunk for several steps); the first other event stays queued."""
    index, event = item
    if not isinstance(event, Tokens):
        return item
    ids, logprobs = list(event.ids), None if event.logprobs is None else list(event.logprobs)
    while not events.empty() and _is_tokens_of(events._queue[0], index):  # noqa: SLF001  (peek, no await)
        more = events.get_nowait()[1]
        ids += more.ids
        if logprobs is not None:
            logprobs += more.logprobs
    return index, Tokens(ids, logprobs)


def _is_tokens_of(item: tuple, index: int) -> bool:
    return item[0] == index and isinstance(item[1], Tokens)


async def _no_route(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 (no route) and 405 (a route, another method) as OpenAI error bodies."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = (f"there is no route {where}; this server serves POST /v1/completions, POST /v1/chat/completions, "
                   "GET /v1/models, /health, /metrics and /openapi.json.")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "another method")
        message = f"{where} is not served; {request.url.path} takes {allowed}."
    else:
        message = exc.detail
    response = error(exc.status_code, message)
    response.headers.update(exc.headers or {})  # 405: Allow
    return response


def create_app(session, engine: Engine, model_name: str, limits: Limits | None = None,
               chat_template: ChatTemplate | None = None) -> Starlette:
    routes = Routes(session, engine, model_name, limits or Limits(), chat_template)
    return Starlette(routes=[
        Route("/health", routes.health),
        Route("/metrics", routes.metrics),
        Route("/v1/models", routes.models),
        Route("/openapi.json", routes.openapi),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    ], exception_handlers={HTTPException: _no_route})
