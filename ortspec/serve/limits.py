"""What one connection or request may cost the server: the limits, checked at start-up.

    request_timeout   seconds a request may wait for a row and run (a body's "timeout" may ask less)
    max_body_bytes    a body over this gets 413 (Content-Length first, then as it arrives)
    max_prompt_chars  a text prompt (chat: the messages' contents) over this many characters gets
                      413 before it is tokenized; default: 4 x max_length x the longest token of
                      the vocabulary, so only a prompt that could never fit is refused (the 4:
                      a tokenizer's normalizer may compose up to about 3 characters into one)
    body_timeout      seconds to receive a whole body once its headers are in: 408
    header_timeout    seconds a connection may take, from opening or from its last response, to
                      send a request line and headers; then it is closed. uvicorn alone times
                      out only idle keep-alive connections, and any byte resets that timer

Headers are bounded by h11 (headers still incomplete past 16 KiB, uvicorn's
h11_max_incomplete_event_size, get 400), idle keep-alive connections close after uvicorn's 5 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from .. import validation
from ..errors import ConfigurationError

log = logging.getLogger("ortspec.serve")
LENGTH_MARGIN = 4  # max_prompt_chars' default: characters a token may come from, times its longest text


@dataclasses.dataclass(frozen=True)
class Limits:
    request_timeout: float = 600.0
    max_body_bytes: int = 16 * 2**20
    max_prompt_chars: int | None = None  # None: from the model (default_prompt_chars)
    body_timeout: float = 30.0
    header_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("request_timeout", "body_timeout", "header_timeout"):
            object.__setattr__(self, name, seconds(name, getattr(self, name)))
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


def _flag(name: str) -> str:
    return name.replace("_", "-")


def default_prompt_chars(session) -> int | None:
    """LENGTH_MARGIN x max_length x the longest token's text (None: no tokenizer, so no text prompts)."""
    if session.manifest.tokenizer_path is None:
        return None
    longest = max(map(len, session.tokenizer.get_vocab()), default=1)
    return LENGTH_MARGIN * session.manifest.max_length * longest


def header_timeout_protocol(timeout: float):
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all
    arrived ``timeout`` seconds after it opened or after its last response."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle.response_complete:  # else a pipelined request began inside super()
                self._arm_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._waiting_since:  # a request's headers are in
                self._disarm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            if not self.transport.is_closing():
                self._waiting_since = self.cycle
                self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._waiting_since and not self.transport.is_closing():
                log.info("closed a connection from %s: no whole request line and headers within %g s (--header-timeout)",
                         "%s:%d" % self.client if self.client else "?", timeout)
                self.transport.close()

    return HeaderTimeoutProtocol
