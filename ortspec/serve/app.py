"""The HTTP side (Starlette): OpenAI-compatible routes over the engine thread.

    GET  /health                 200 {"status": "ok"} (503 once the engine failed)
    GET  /metrics                Prometheus text: tokens/s, acceptance, queue depth, running requests, ...
    GET  /v1/models              the one model served
    POST /v1/completions         prompt -> text, or server-sent events with "stream": true
    POST /v1/chat/completions    messages -> text, when the model directory has a chat template

A handler checks and tokenizes the request (400 on anything wrong, before it is queued),
submits a Job (429 when the queue is full) and reads the job's events from an asyncio queue
that the engine thread posts into. A client that disconnects (a stream's send fails, or a
waiting request notices) cancels its job, which frees its row at the engine's next turn.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..detokenizer import IncrementalDetokenizer
from ..errors import OrtspecError
from . import protocol
from .chat import ChatTemplate, TemplateError
from .engine import Engine, Failed, Finished, Job, QueueFull, Tokens
from .metrics import prometheus_text

DISCONNECT_POLL = 0.5  # seconds between disconnect checks of a waiting non-streamed request


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, status), status_code=status)


class Routes:
    def __init__(self, session, engine: Engine, model_name: str, request_timeout: float,
                 chat_template: ChatTemplate | None) -> None:
        self.session, self.engine, self.model = session, engine, model_name
        self.request_timeout, self.chat_template = request_timeout, chat_template
        self.has_tokenizer = session.manifest.tokenizer_path is not None

    async def health(self, request: Request) -> Response:
        if self.engine.error:
            return JSONResponse({"status": "error", "error": self.engine.error}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus_text(self.engine, self.session.stats),
                                 media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "ortspec"}]})

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        if self.chat_template is None:
            return error(404, f"{self.session.manifest.dir} has no chat template (tokenizer_config.json "
                              "'chat_template'); use /v1/completions with a prompt.")
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        try:
            req = protocol.completion(protocol.parse_json(await request.body()), chat, self.request_timeout)
            prompt = self.chat_template.render(req.messages) if chat else req.prompt
            [checked] = self.session.new_requests(prompt, req.max_tokens, min_new_tokens=1,
                                                  sampling=req.sampling).requests
        except (protocol.BadRequest, TemplateError, OrtspecError) as exc:
            return error(400, str(exc))
        events: asyncio.Queue = asyncio.Queue()
        job = Job(checked.prompt, req.max_tokens, req.sampling, time.monotonic() + req.timeout,
                  deliver=_poster(asyncio.get_running_loop(), events))
        try:
            self.engine.submit(job)
        except QueueFull as exc:
            return error(429 if not self.engine.error else 503, str(exc))
        if req.stream:
            return StreamingResponse(self._events(request, req, job, events), media_type="text/event-stream")
        return await self._whole(request, req, job, events)

    def _detokenizer(self) -> IncrementalDetokenizer | None:
        return IncrementalDetokenizer(self.session.tokenizer) if self.has_tokenizer else None

    async def _next_event(self, request: Request, events: asyncio.Queue):
        """The job's next event, or None once the client has disconnected (checked every
        DISCONNECT_POLL seconds while nothing arrives, so a client gone while its job waits or
        runs is noticed without a write failing)."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), DISCONNECT_POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    async def _whole(self, request: Request, req, job: Job, events: asyncio.Queue) -> Response:
        """Waits for the whole completion."""
        ids = []
        while True:
            event = await self._next_event(request, events)
            if event is None:
                self.engine.cancel(job)
                return Response(status_code=499)  # nobody reads it
            if isinstance(event, Tokens):
                ids += event.ids
            elif isinstance(event, Failed):
                return error(event.status, event.message)
            else:
                text = self.session.tokenizer.decode(ids) if self.has_tokenizer else ""
                return JSONResponse(protocol.response(req, self.model, text, ids, event.reason, len(job.prompt)))

    async def _events(self, request: Request, req, job: Job, events: asyncio.Queue):
        """Server-sent events as tokens commit; the job is cancelled if the client goes away."""
        detokenizer, done, count = self._detokenizer(), False, 0
        try:
            while not done:
                event = await self._next_event(request, events)
                if event is None:
                    return
                if isinstance(event, Tokens) and event.ids:  # text "" while a character is unfinished
                    count += len(event.ids)
                    yield protocol.chunk(req, self.model, detokenizer.add(event.ids) if detokenizer else "", event.ids)
                elif isinstance(event, Finished):
                    done = True
                    yield protocol.chunk(req, self.model, detokenizer.finish() if detokenizer else "", [],
                                         finish_reason=event.reason)
                    if req.include_usage:
                        yield protocol.chunk(req, self.model, "", [], usage_counts=protocol.usage(len(job.prompt),
                                                                                                   count))
                    yield protocol.DONE
                elif isinstance(event, Failed):
                    done = True
                    yield f"data: {json.dumps(protocol.error_body(event.message, event.status))}\n\n"
        finally:
            if not done:
                self.engine.cancel(job)


def _poster(loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
    """deliver(event) for the engine thread: puts the event into this handler's queue, on its loop."""

    def deliver(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop has closed (the server stopped): nobody reads it any more
            pass

    return deliver


def create_app(session, engine: Engine, model_name: str, request_timeout: float = 600.0,
               chat_template: ChatTemplate | None = None) -> Starlette:
    routes = Routes(session, engine, model_name, request_timeout, chat_template)
    return Starlette(routes=[
        Route("/health", routes.health),
        Route("/metrics", routes.metrics),
        Route("/v1/models", routes.models),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    ])
