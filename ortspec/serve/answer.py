"""One request's answer as the engine's events arrive, and the bodies built from it.

A request of n choices runs as n jobs (rows of the batch); each ``Choice`` collects its job's
tokens, their log-probabilities and its text. The text goes through ``StopStrings`` with the
request's stop strings: the loop ended the request at the token that completed one, and here
the text is cut before it; a stream holds back text that could be the start of one until it
is known not to be. ``whole`` is the response body; ``echo_chunks``, ``chunk`` and
``usage_chunk`` are a stream's events.
"""

from __future__ import annotations

from ..stop_strings import StopStrings
from . import protocol
from .engine import Finished, Tokens
from .logprobs import TokenTexts, chat_logprobs, completion_logprobs


class Choice:
    def __init__(self, index: int, tokenizer, stops: tuple[str, ...], offsets: bool) -> None:
        self.index = index
        self.text = StopStrings(tokenizer, stops, offsets) if tokenizer is not None else None
        self.ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None

    def add(self, tokens: Tokens) -> str:
        """Takes the job's next tokens; returns the text they release."""
        self.ids += tokens.ids
        self.logprobs += tokens.logprobs or []
        if self.text is None:
            return ""
        self.text.add(tokens.ids)
        return self.text.take()

    def finish(self, reason: str) -> str:
        """The job finished; returns the text held back until now."""
        self.finish_reason = reason
        if self.text is None:
            return ""
        self.text.finish()
        return self.text.take()


class Answer:
    """req: the checked request; echo: the prompt's text where req.echo asks for it."""

    def __init__(self, req: protocol.Completion, model: str, prompt_tokens: int, tokenizer, texts: TokenTexts,
                 echo: str = "") -> None:
        self.req, self.model, self.prompt_tokens, self.texts, self.echo = req, model, prompt_tokens, texts, echo
        offsets = req.logprobs is not None and not req.chat  # completions' text_offset
        self.choices = [Choice(i, tokenizer, req.stop, offsets) for i in range(req.n)]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def take(self, index: int, event: Tokens | Finished) -> dict:
        """The event into choice `index`; returns the stream chunk's choice for it."""
        choice = self.choices[index]
        if isinstance(event, Finished):
            return protocol.choice(self.req, index, choice.finish(event.reason), [], event.reason, stream=True)
        start = len(choice.ids)
        piece = choice.add(event)
        return protocol.choice(self.req, index, piece, event.ids, None, self._logprobs(choice, start), stream=True)

    def whole(self) -> dict:
        choices = [protocol.choice(self.req, c.index, self.echo + (c.text.text if c.text else ""), c.ids,
                                   c.finish_reason, self._logprobs(c, 0)) for c in self.choices]
        return protocol.response(self.req, self.model, choices, self.prompt_tokens, self._completion_tokens())

    def chunk(self, index: int, event: Tokens | Finished) -> str:
        return protocol.chunk(self.req, self.model, [self.take(index, event)])

    def echo_chunks(self) -> list[str]:
        """A stream's first events: each choice's echoed prompt (none without echo)."""
        if not self.req.echo:
            return []
        return [protocol.chunk(self.req, self.model, [protocol.choice(self.req, c.index, self.echo, [], None,
                                                                      stream=True)]) for c in self.choices]

    def usage_chunk(self) -> str:
        return protocol.chunk(self.req, self.model, [], protocol.usage(self.prompt_tokens, self._completion_tokens()))

    def _completion_tokens(self) -> int:
        return sum(len(c.ids) for c in self.choices)

    def _logprobs(self, choice: Choice, start: int) -> dict | None:
        """The logprobs object of choice's tokens from `start` (None where the request asks none)."""
        if self.req.logprobs is None:
            return None
        entries = choice.logprobs[start:]
        if self.req.chat:
            return chat_logprobs(entries, self.texts)
        starts = choice.text.starts[start: start + len(entries)] if choice.text else [0] * len(entries)
        return completion_logprobs(entries, self.texts, [len(self.echo) + at for at in starts])
