"""Text from token ids as they arrive, for streaming: pieces that never split a character.

A byte-level BPE token may hold part of a UTF-8 character (an emoji is often 2-4 tokens);
decoded alone it reads as U+FFFD. So the decoder holds text back while it ends in U+FFFD,
and decodes a short window of recent tokens rather than everything so far (O(window) per
token, not O(length)): the window starts at the last piece's start (``prefix``), so text
that depends on the token before it (a leading space) decodes as in the whole sequence.
Joined, the pieces and ``finish()`` equal ``tokenizer.decode(all ids)`` (checked by the tests
on byte-level tokenizers, the kind ortspec's models ship).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window: the ids before it are emitted and fixed
        self.read = 0  # the ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids) -> str:
        """Takes new token ids; returns the text they complete ("" while a character is unfinished)."""
        self.ids.extend(int(t) for t in ids)
        emitted = self._decode(self.ids[self.prefix: self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(emitted) or text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(emitted):]

    def finish(self) -> str:
        """The text still held back (an unfinished character at the end decodes as U+FFFD)."""
        emitted = self._decode(self.ids[self.prefix: self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(emitted):]
