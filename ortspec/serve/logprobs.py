"""The OpenAI logprobs objects of a choice, from the loop's ``TokenLogprob`` entries.

    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
                  "text_offset": [...]}   (offsets: characters into the choice's text, echo included)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                  "bytes"}, ...]}, ...]}

Values are the model's log-softmax of the raw logits (``speculative/logprobs.py``). A token's
text is its bytes decoded (a token that holds part of a character reads U+FFFD; ``bytes`` has
the part), special tokens by their names.
"""

from __future__ import annotations

import functools

from ..speculative.logprobs import TokenLogprob


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


class TokenTexts:
    """Each token id's (text, bytes), read from the tokenizer once."""

    def __init__(self, tokenizer) -> None:  # None: a model without one (every text "")
        self.tokenizer = tokenizer
        self.byte_level = type(getattr(tokenizer, "decoder", None)).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        if token not in self._cache:
            self._cache[token] = self._read(token)
        return self._cache[token]

    def _read(self, token: int) -> tuple[str, bytes]:
        if self.tokenizer is None:
            return "", b""
        piece, table = self.tokenizer.id_to_token(token) or "", _byte_of_char()
        if self.byte_level and all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), raw
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        return text, text.encode("utf-8")


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offsets: list[int]) -> dict:
    return {"tokens": [texts(e.token)[0] for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{texts(t)[0]: lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    def item(token: int, logprob: float) -> dict:
        text, raw = texts(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
