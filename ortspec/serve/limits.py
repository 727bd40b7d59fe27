"""What one connection or request may cost the server: the limits, checked at start-up.

    request_timeout   seconds a request may wait for a row and run (a body's "timeout" may ask less)
    max_body_bytes    a body over this gets 413 (Content-Length first, then as it arrives); one
                      of more commas (JSON values) than max_commas too, before it is parsed
    max_prompt_chars  a text prompt (chat: the messages' contents, then the prompt the template
                      renders from them) over this many characters gets
                      413 before it is tokenized; default: 4 x max_length x the longest token of
                      the vocabulary, so only a prompt that could never fit is refused (the 4:
                      a tokenizer's normalizer may compose up to about 3 characters into one)
    body_timeout      seconds to receive a whole body once its headers are in: 408
    header_timeout    seconds a connection may take, from opening or from its last response, to
                      send a request line and headers; then it is closed. uvicorn alone times
                      out only idle keep-alive connections, and any byte resets that timer
    send_timeout      seconds a response may wait on a client that does not read it (its
                      socket's buffers full); then the connection is dropped, which cancels
                      the request (SendTimer). uvicorn alone waits for such a client forever,
                      the answer's events piling up in memory meanwhile
    max_connections   connections open at once; one past it is answered 503 as it opens and
                      closed (ConnectionCap); default: from the process's file limit
                      (default_connections)

A request line and headers over MAX_HEADER_BYTES (16 KiB) get 431 and the connection closes:
counted here on httptools (http_stack: what the serve extra installs), which takes headers of
any length; with h11 (the fallback) its own buffer bounds them (still incomplete past it).
A request the parser cannot read (a bad Content-Length, a broken chunk, a header line without
a colon) gets 400 with the parser's reason, both in OpenAI's error body (uvicorn answers plain
text), and the connection closes; on httptools after the responses owed to the requests
pipelined before it. Idle keep-alive connections close after uvicorn's 5 s (or the header timeout,
if shorter: it runs from the last response too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import importlib
import json
import logging
import re
import resource
import sys

from .. import validation
from ..errors import ConfigurationError
from . import protocol

log = logging.getLogger("ortspec.serve")
MAX_HEADER_BYTES = 16 * 1024  # a request line and headers: past it 431 (httptools), 400 (h11: its own bound)
LENGTH_MARGIN = 4  # max_prompt_chars' default: characters a token may come from, times its longest text
MAX_CONNECTIONS = 4096  # max_connections' default where the file limit allows it
RESERVED_FILES = 256  # descriptors kept for the rest of the process: the model's files, the engine's pipes, logs
COMMA_SLACK = 4096  # max_commas: the fields beside the prompt (stop strings, options)
TURN_AWAY_SECONDS = 1.0  # a connection past the cap is closed this long after its 503 (so the 503 is read)


@dataclasses.dataclass(frozen=True)
class Limits:
    request_timeout: float = 600.0
    max_body_bytes: int = 16 * 2**20
    max_prompt_chars: int | None = None  # None: from the model (default_prompt_chars)
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    send_timeout: float = 30.0
    max_connections: int | None = None  # None: from the file limit (default_connections)

    def __post_init__(self) -> None:
        for name in ("request_timeout", "body_timeout", "header_timeout", "send_timeout"):
            object.__setattr__(self, name, seconds(name, getattr(self, name)))
        object.__setattr__(self, "max_connections", connections(self.max_connections))
        object.__setattr__(self, "max_body_bytes", validation.integer(
            "max_body_bytes", self.max_body_bytes, ConfigurationError, 1, f" (--{_flag('max_body_bytes')})"))
        if self.max_prompt_chars is not None:
            object.__setattr__(self, "max_prompt_chars", validation.integer(
                "max_prompt_chars", self.max_prompt_chars, ConfigurationError, 1, f" (--{_flag('max_prompt_chars')})"))

    def with_model(self, session) -> "Limits":
        """These limits with max_prompt_chars derived from the model where it was not given."""
        if self.max_prompt_chars is not None:
            return self
        return dataclasses.replace(self, max_prompt_chars=default_prompt_chars(session))


def seconds(name: str, value) -> float:
    number = validation.finite(name, value, ConfigurationError, f"a number of seconds > 0 (--{_flag(name)})")
    if number <= 0:
        raise ConfigurationError(f"{name}={value!r} must be a number of seconds > 0 (--{_flag(name)}).")
    return number


def connections(value: int | None) -> int:
    """max_connections checked against the file limit: a turned-away connection holds its
    descriptor for up to TURN_AWAY_SECONDS, and at most max_connections of them are answered at
    a time, so the server needs 2 x max_connections + RESERVED_FILES descriptors."""
    files = file_limit()
    most = (files - RESERVED_FILES) // 2
    if value is None:
        if most < 1:
            raise ConfigurationError(f"the process may open {files} files (ulimit -n), too few to serve connections "
                                     f"and keep {RESERVED_FILES} for the model; raise it.")
        return min(MAX_CONNECTIONS, most)
    value = validation.integer("max_connections", value, ConfigurationError, 1, " (--max-connections)")
    if value > most:
        raise ConfigurationError(f"max_connections={value} needs {2 * value + RESERVED_FILES} file descriptors and the "
                                 f"process may open {files} (ulimit -n); raise that limit or lower --max-connections "
                                 f"to at most {max(most, 0)}.")
    return value


def file_limit() -> int:
    """How many descriptors this process may open (RLIMIT_NOFILE's soft limit; unlimited counts as 2**20)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**20 if soft == resource.RLIM_INFINITY else soft


def _flag(name: str) -> str:
    return name.replace("_", "-")


def default_prompt_chars(session) -> int | None:
    """LENGTH_MARGIN x max_length x the longest token's text (None: no tokenizer, so no text prompts)."""
    if session.manifest.tokenizer_path is None:
        return None
    longest = max(map(len, session.tokenizer.get_vocab()), default=1)
    return LENGTH_MARGIN * session.manifest.max_length * longest


def max_commas(max_prompt_chars: int | None, max_length: int) -> int:
    """The most commas a body this model could be served may hold: one a text character (the
    prompt, a chat's contents, at most max_prompt_chars), three more a chat message or part (each
    adds to the rendered prompt, also at most max_prompt_chars), one a token id (max_length) and
    COMMA_SLACK for the other fields. Counted before the body is parsed (a C scan, milliseconds
    for 16 MiB): parsing costs per value, and a body of millions of numbers would cost seconds."""
    return 4 * (max_prompt_chars or 0) + max_length + COMMA_SLACK


def http_stack() -> tuple[str, str]:
    """(HTTP parser, event loop) for uvicorn: httptools and uvloop, which the serve extra installs
    (the faster pair: docs/serving.md), each where it imports; else h11,
    asyncio."""
    return ("httptools" if _imports("httptools") else "h11", "uvloop" if _imports("uvloop") else "asyncio")


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def limited_protocol(parser: str, limits: Limits):
    """uvicorn's protocol for parser ("httptools" or "h11") with the header bound and timeout, the
    send timeout and the connection cap."""
    protocol = httptools_protocol if parser == "httptools" else h11_protocol
    return protocol(limits.header_timeout, limits.max_connections, limits.send_timeout)


TOO_MANY_CONNECTIONS = ("the server holds as many connections as it takes ({}, --max-connections); retry in a moment, "
                        "reusing one connection for many requests (keep-alive) rather than opening one per request.")


class ConnectionCap:
    """(a mixin for uvicorn's protocols, before HeaderTimer) A connection that opens while
    ``max_connections`` are open gets a 503 at once and is closed TURN_AWAY_SECONDS later, what it
    sends meanwhile read and dropped (closing a socket with unread bytes resets it, and the 503
    with it). uvicorn's limit_concurrency is not used: it answers plain text, and only to a
    request, leaving the idle connections it counts open. Past twice the cap a connection is
    closed unanswered, so the descriptors stay bounded while connections arrive faster than
    TURN_AWAY_SECONDS lets them go."""

    max_connections: int
    _turned_away = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._turn_away()

    def data_received(self, data: bytes) -> None:
        if not self._turned_away:
            super().data_received(data)

    def _turn_away(self) -> None:
        self._turned_away = True
        self._disarm_header_timer()
        log.info("turned away a connection from %s: %d are open (--max-connections %d)", _peer(self.client),
                 len(self.connections) - 1, self.max_connections)
        if len(self.connections) > 2 * self.max_connections:
            self.transport.close()
            return
        message = TOO_MANY_CONNECTIONS.format(self.max_connections)
        self.transport.write(refusal(503, message, self.server_state.default_headers))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(TURN_AWAY_SECONDS, self.transport.close)


class HeaderTimer:
    """(a mixin for uvicorn's protocols) Closes a connection whose request line and headers have
    not all arrived ``header_timeout`` seconds after it opened or after its last response; the
    protocol calls _disarm_header_timer once a request's headers are in, _arm_header_timer once
    a response is complete with no request waiting behind it."""

    header_timeout: float
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closed a connection from %s: no whole request line and headers within %g s (--header-timeout)",
                     _peer(self.client), self.header_timeout)
            self.transport.close()


class SendTimer:
    """(a mixin for uvicorn's protocols) Drops a connection whose writes have waited
    ``send_timeout`` seconds: asyncio pauses a protocol's writing once its transport buffers more
    than the high-water mark (the kernel's buffer full: the client reads nothing, or too little
    for that long), and uvicorn's send then waits until it resumes, with no bound. abort(), not
    close(), which would wait for the buffer to drain; uvicorn sees the connection lost and its
    handler a disconnect, which cancels the request."""

    send_timeout: float
    _send_timer: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._not_read)

    def resume_writing(self) -> None:
        self._disarm_send_timer()
        super().resume_writing()

    def connection_lost(self, exc) -> None:
        self._disarm_send_timer()
        super().connection_lost(exc)

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _not_read(self) -> None:
        self._send_timer = None
        log.info("dropped a connection from %s: its response waited %g s for it to read (--send-timeout)",
                 _peer(self.client), self.send_timeout)
        self.transport.abort()


class NoWebSockets:
    """(a mixin for uvicorn's protocols; the server runs with ws="none") An Upgrade request is served
    as plain HTTP, logged as that: uvicorn's own warning told the operator to install a WebSocket
    library, for routes this server does not have."""

    def _unsupported_upgrade_warning(self) -> None:
        log.info("served a request from %s as plain HTTP: it asked to upgrade, and this server has no WebSocket "
                 "routes", _peer(self.client))


def _peer(client) -> str:
    return "%s:%d" % client if client else "?"


HEADERS_TOO_LARGE = (f"the request line and headers are over {MAX_HEADER_BYTES} bytes, more than this server takes; "
                     "send fewer or shorter headers.")


def unreadable(exc: BaseException | None) -> tuple[int, str]:
    """(status, message) for a request the HTTP parser refused with exc (h11's RemoteProtocolError,
    httptools' HttpParserError): 431 where h11 says its buffer overflowed, else 400 with its reason.
    The offending bytes, which both append as Python shows them (bytearray(b'...'), b'...'), are
    left out; httptools' "User callback error" gives way to the parser error inside it (uvicorn
    parses the URL in a callback: "invalid url")."""
    if getattr(exc, "error_status_hint", 400) == 431:
        return 431, HEADERS_TOO_LARGE
    inner = getattr(exc, "__context__", None)
    if inner is not None and type(inner).__module__.startswith("httptools"):
        exc = inner
    reason = re.split(r":? (?:bytearray\()?b['\"]", str(exc))[0] if exc is not None else ""
    if reason == "User callback error":  # something else failed inside a callback: nothing to name
        reason = ""
    return 400, (f"the request is not valid HTTP/1.1 ({reason or 'the parser refused it'}); check its request line, "
                 "its headers and its body's framing (one Content-Length of digits, or Transfer-Encoding: chunked "
                 "with hexadecimal chunk sizes), then send it again on a new connection.")


def refusal(status: int, message: str, default_headers) -> bytes:
    """A whole response in OpenAI's error body, ending the connection (written to the transport
    by the protocol, which closes it after)."""
    body = json.dumps(protocol.error_body(message, status)).encode()
    head = [b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode()),
            *(b"%s: %s\r\n" % pair for pair in default_headers),
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)]
    return b"".join(head) + body


def h11_protocol(timeout: float, cap: int, send: float):
    """uvicorn's h11 protocol with the header timeout, the connection cap and JSON refusals; h11
    bounds the headers itself (past MAX_HEADER_BYTES still incomplete: 431)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11Limits(NoWebSockets, ConnectionCap, SendTimer, HeaderTimer, H11Protocol):
        header_timeout, max_connections, send_timeout = timeout, cap, send

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle.response_complete:  # else a pipelined request began inside super()
                self._arm_header_timer()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are in
                self._disarm_header_timer()

        def send_400_response(self, msg: str) -> None:  # inside handle_events' except RemoteProtocolError
            status, message = unreadable(sys.exc_info()[1])
            log.info("refused a request from %s with %d: %s", _peer(self.client), status, message)
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # else a response is under way: close alone
                self.transport.write(refusal(status, message, self.server_state.default_headers))
            self.transport.close()

    return H11Limits


class HeadersTooLarge(Exception):
    """(raised inside httptools' on_headers_complete: its feed_data then fails) Whole headers over the bound."""


def httptools_protocol(timeout: float, cap: int, send: float):
    """uvicorn's httptools protocol with the header timeout, the connection cap, JSON refusals and a bound of its own:
    httptools takes headers of any length, so a request whose line and headers pass
    MAX_HEADER_BYTES, still incomplete or whole, gets 431 and its connection closes. httptools
    parses pipelined requests as they arrive: one it refuses is answered after the responses owed
    to those before it (uvicorn wrote its 400 at once, and the earlier responses were lost)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsLimits(NoWebSockets, ConnectionCap, SendTimer, HeaderTimer, HttpToolsProtocol):
        header_timeout, max_connections, send_timeout = timeout, cap, send
        _header_bytes: int | None = 0  # bytes since this request began, until its headers are in (then None)
        _refusal: bytes | None = None  # the answer to a refused request, waiting for _owed responses before it
        _owed = 0

        def data_received(self, data: bytes) -> None:
            if self._refusal is not None or self._turned_away:  # the parser has failed, or the cap: nothing is read
                return None
            if self._header_bytes is None:  # a body: the next request counts from its end (on_message_complete)
                return super().data_received(data)
            self._header_bytes += len(data)
            super().data_received(data)
            if self._over_the_bound() and not self.transport.is_closing() and self._refusal is None:
                self._refuse(431, HEADERS_TOO_LARGE)

        def on_headers_complete(self) -> None:
            if self._over_the_bound() and header_bytes(self.url, self.headers) > MAX_HEADER_BYTES:
                raise HeadersTooLarge  # the last read brought whole headers and more: answered in send_400_response
            self._header_bytes = None
            self._disarm_header_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._header_bytes = 0  # the next request's line and headers count from here

        def on_response_complete(self) -> None:
            waiting = bool(self.pipeline)  # a request whose headers are in, started inside super()
            super().on_response_complete()
            if self._refusal is not None:
                self._owed -= 1
                if self._owed == 0 and not self.transport.is_closing():
                    self.transport.write(self._refusal)
                    self.transport.close()
            elif not waiting:
                self._arm_header_timer()

        def send_400_response(self, msg: str) -> None:  # inside data_received's except HttpParserError
            self._refuse(*((431, HEADERS_TOO_LARGE) if self._over_the_bound() else unreadable(sys.exc_info()[1])))

        def _over_the_bound(self) -> bool:
            return self._header_bytes is not None and self._header_bytes > MAX_HEADER_BYTES

        def _refuse(self, status: int, message: str) -> None:
            """Answers the request the parser refused and closes the connection: at once, or once
            the responses owed to the requests pipelined before it are out (on_response_complete)."""
            log.info("refused a request from %s with %d: %s", _peer(self.client), status, message)
            reply, cycle = refusal(status, message, self.server_state.default_headers), self.cycle
            if cycle is not None and cycle.more_body:  # the refused request's own body broke
                if self.pipeline and self.pipeline[0][0] is cycle:  # queued behind others: it never runs
                    self.pipeline.popleft()
                    self._defer(reply)
                elif not cycle.response_started:  # running, unanswered: its handler sees a disconnect
                    self._answer(reply)
                else:  # its response is under way: no second status line in it
                    self.transport.close()
            elif cycle is None or (cycle.response_complete and not self.pipeline):
                self._answer(reply)
            else:  # a request after those parsed: they are owed their responses first
                self._defer(reply)

        def _answer(self, reply: bytes) -> None:
            if not self.transport.is_closing():
                self.transport.write(reply)
                self.transport.close()

        def _defer(self, reply: bytes) -> None:
            self._refusal, self._owed = reply, len(self.pipeline) + 1  # the queued ones and the one running
            self.flow.pause_reading()

    return HttpToolsLimits


def header_bytes(url: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """About the size of a request line and headers as sent: the URL, names and values, 4 bytes a
    header (": ", CRLF)."""
    return len(url) + sum(len(name) + len(value) + 4 for name, value in headers)
