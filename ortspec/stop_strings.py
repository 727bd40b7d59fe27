"""A request's text as its tokens arrive, cut before the first of its stop strings.

A stop string may span tokens, so it is looked for in the decoded text, token by token (the
text a step's later tokens add is past the stop, and the tokens that end a request must not
depend on how many a step emitted). Text is handed out (``take``) only where no later token
can make it part of a stop string: a tail that could be the start of one is held back until
it is known not to be. Without stop strings this is the text of the tokens, in pieces that
never split a character (``detokenizer.IncrementalDetokenizer``).

    text = StopStrings(tokenizer, ["\\n\\n"])
    taken = text.add(ids)        # None, or how many of ids were taken when one completed a stop
    text.take()                  # the text not handed out before that no later token can cut
    text.finish()                # the request ended: the held-back tail is text too
"""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer


class StopStrings:
    """offsets=True: ``starts`` gets, for each token taken, the length of the text before it
    (OpenAI's text_offset); tokens are then decoded one by one."""

    def __init__(self, tokenizer, stops=(), offsets: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""  # the text so far; once stopped, up to the stop string's start
        self.starts: list[int] | None = [] if offsets else None
        self.stopped = self.finished = False
        self._sent = 0  # characters take() handed out
        self._searched = 0  # no stop string starts before this less longest - 1

    def add(self, ids) -> int | None:
        """Takes token ids; returns i + 1 when ids[i] completed a stop string (the ids after it are
        not taken), else None."""
        if self.stopped or self.finished:
            return None
        if not self.stops and self.starts is None:
            self.text += self.detokenizer.add(ids)
            return None
        for i, token in enumerate(ids):
            if self.starts is not None:
                self.starts.append(len(self.text))
            self.text += self.detokenizer.add([token])
            if self._cut():
                return i + 1
        return None

    def finish(self) -> bool:
        """No more tokens: the text held back for an unfinished character joins the text (a stop
        string may be found in it). Returns whether the text stopped at a stop string."""
        if not (self.stopped or self.finished):
            self.finished = True
            self.text += self.detokenizer.finish()
            self._cut()
        return self.stopped

    def take(self) -> str:
        """The text not taken before that no later token can make part of a stop string."""
        end = len(self.text) if self.stopped or self.finished else len(self.text) - self._held()
        piece = self.text[self._sent: end]
        self._sent = max(self._sent, end)
        return piece

    def _cut(self) -> bool:
        """Cuts the text before the first stop string in it (only new text can hold one)."""
        if not self.stops:
            return False
        start = max(0, self._searched - self.longest + 1)
        found = [at for at in (self.text.find(s, start) for s in self.stops) if at >= 0]
        self._searched = len(self.text)
        if found:
            self.text, self.stopped = self.text[: min(found)], True
        return self.stopped

    def _held(self) -> int:
        """The length of the longest end of the text that is the start of a stop string."""
        for n in range(min(self.longest - 1, len(self.text) - self._sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
