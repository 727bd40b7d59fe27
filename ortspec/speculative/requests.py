"""Per-request bookkeeping and the batch view a step works on (built fresh each step)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InternalError
from ..runtime.states import Rows
from ..stop_strings import StopStrings
from .logprobs import TokenLogprob
from .sampling import GREEDY, SamplingParams


@dataclasses.dataclass
class Request:
    """One prompt being decoded in batch row ``row``.

    ``tokens`` is prompt + generated; the target has processed all but the last one
    (``processed`` = T), and the last is the pending token the next step feeds first.
    ``sampling`` says how its tokens are chosen (greedy by default) and ``random`` is its own
    random stream (None when greedy), so its draws never depend on the rows beside it.
    ``stop_strings`` (when it has any) reads its text as tokens arrive and ends it at the token
    that completes one; ``logprobs`` (an int N) asks for each token's log-probability and the N
    most probable alternatives, kept beside the tokens (``token_logprobs``).
    """

    row: int
    prompt: list[int]
    max_new_tokens: int
    stop_tokens: frozenset = frozenset()
    tokens: list[int] = dataclasses.field(default_factory=list)
    next_drafts: list[int] = dataclasses.field(default_factory=list)  # d1..dk from the last catch-up
    draft_probs: np.ndarray | None = None  # [k, V] what a sampled request's next_drafts were drawn from
    sampling: SamplingParams = GREEDY
    random: np.random.Generator | None = None
    stop_strings: StopStrings | None = None
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # by generated token
    finish_reason: str | None = None  # "stop" (a stop token or string), "length" (max_new_tokens), "cancelled", "error"
    error: BaseException | None = None  # why its prefill failed (finish_reason "error")
    last_first_position: int | None = None  # first verify position of the previous step
    last_accepted: int = 0
    done: bool = False
    placeholder: bool = False  # fills a row that must run (CUDA batch buckets); never reported
    _output_length: int | None = None  # set when a stop token or string ends the request

    @classmethod
    def filler(cls, row: int) -> "Request":
        return cls(row=row, prompt=[0], max_new_tokens=1, placeholder=True)

    @property
    def samples(self) -> bool:
        return not self.sampling.greedy

    @property
    def processed(self) -> int:
        return len(self.tokens) - 1

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    def extend(self, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Appends committed tokens (and, where the request asks, their log-probabilities); marks
        the request done at max_new_tokens, a stop token or a stop string (only the new tokens
        are scanned: a step costs the same at any length)."""
        before, first = len(self.tokens) - len(self.prompt), len(self.prompt)
        self.tokens.extend(map(int, new_tokens))
        if self.logprobs is not None:
            self._keep_logprobs(len(new_tokens), logprobs)
        generated = len(self.tokens) - first
        end = None
        if self.stop_tokens:
            for i in range(before, min(generated, self.max_new_tokens)):
                if self.tokens[first + i] in self.stop_tokens:
                    end = i + 1  # just past a stop token
                    break
        if self.stop_strings is not None:
            taken = self.stop_strings.add(self.tokens[first + before: first + (end or self.max_new_tokens)])
            end = before + taken if taken is not None else end
        if end is not None:
            self.done, self._output_length, self.finish_reason = True, end, "stop"
        else:
            self.done = generated >= self.max_new_tokens
            self.finish_reason = "length" if self.done else None
        if self.done:
            self._finish_text()

    def _keep_logprobs(self, count: int, logprobs: list[TokenLogprob] | None) -> None:
        if logprobs is None or len(logprobs) != count:
            raise InternalError(f"a step emitted {count} tokens for a request that asks for log-probabilities, "
                                f"with {'none' if logprobs is None else len(logprobs)}: the step ran as a kind that "
                                "keeps the logits on the device (step_kinds.StepKinds.choose).")
        self.token_logprobs.extend(logprobs)

    def _finish_text(self) -> None:
        """The request ended: the text's held-back tail joins it, and may hold a stop string."""
        if self.stop_strings is not None and self.stop_strings.finish():
            self.finish_reason = "stop"

    def cancel(self) -> None:
        """Ends the request where it is (its row is free for another); output() keeps its tokens."""
        if not self.done:
            self._output_length, self.done, self.finish_reason = self.output_length, True, "cancelled"
            self._finish_text()

    def fail(self, error: BaseException) -> None:
        """Ends a request whose prefill failed before it held its row: no tokens, finish_reason "error"."""
        self._output_length, self.done, self.finish_reason, self.error = 0, True, "error", error

    @property
    def output_length(self) -> int:
        """len(output()), without building it (0 before the prefill gave it its tokens)."""
        if self._output_length is not None:  # a stop token ended it
            return self._output_length
        return max(0, min(len(self.tokens) - len(self.prompt), self.max_new_tokens))

    def output(self, start: int = 0) -> list[int]:
        """Exactly max_new_tokens tokens (surplus accepted drafts dropped), or up to a stop
        token, or up to the token that completed a stop string; from output position `start` on."""
        first = len(self.prompt)
        return self.tokens[first + start: first + self.output_length]

    def output_logprobs(self, start: int = 0) -> list[TokenLogprob]:
        """The log-probabilities of output(start) (the request asks for them)."""
        return self.token_logprobs[start: self.output_length]


class Batch:
    """The requests one step runs, with their rows and lengths as arrays."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = requests
        self.rows = Rows([r.row for r in requests])
        self.processed = np.array([r.processed for r in requests], np.int64)  # T [B]
        self.pending = np.array([r.pending for r in requests], np.int64)  # x_T [B]

    def __len__(self) -> int:
        return len(self.requests)

    def park_finished(self, last_start: int) -> None:
        """Runs finished requests' rows (fixed rows: they keep running, results dropped) from at
        most ``last_start``: the step that finished one may have taken it to max_length, and its
        next forward must still write inside the buffers. Live rows never move."""
        done = np.array([r.done for r in self.requests])
        self.processed = np.where(done, np.minimum(self.processed, last_start), self.processed)
