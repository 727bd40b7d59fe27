"""A model's prompt side without its graphs: the manifest, the tokenizer, and checked requests.

A Session has one; so does a server's HTTP process when the engine runs in a process of its own
(serve/engine_process.py), where prompts are checked and tokenized before they cross over.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from . import validation
from .errors import InputError, ModelDirError
from .manifest import Manifest
from .speculative.requests import Request
from .speculative.sampling import GREEDY, SamplingParams, random_stream
from .stop_strings import StopStrings


class NewRequests(NamedTuple):
    """What ``new_requests`` made of a prompt: the requests, whether the prompt was one prompt
    (not a batch) and whether it was text (outputs are decoded back to text)."""

    requests: list[Request]
    single: bool
    text: bool


class Prompts:
    """reserved: positions of max_length a request may not use (exact mode's exact_k)."""

    def __init__(self, manifest: Manifest, reserved: int = 0) -> None:
        self.manifest, self.reserved = manifest, reserved
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                path = self.manifest.tokenizer_path
                if path is None:
                    raise InputError(
                        f"{self.manifest.dir} has no tokenizer.json, so text prompts cannot be encoded; "
                        "pass token ids (list[int]) or convert a checkpoint that ships tokenizer.json."
                    )
                from tokenizers import Tokenizer

                try:
                    self._tokenizer = Tokenizer.from_file(str(path))
                except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
                    raise ModelDirError(f"{path} does not load as a tokenizer ({exc}); copy the checkpoint's "
                                        "tokenizer.json again and reconvert, or pass token ids.") from None
        return self._tokenizer

    def new_requests(self, prompt, max_new_tokens: int = 32, stop_tokens=None, min_new_tokens: int = 0,
                     sampling: SamplingParams = GREEDY, stop=None, logprobs: int | None = None,
                     seed_index: int = 0) -> NewRequests:
        """Checked requests, in rows 0..n-1, for any prompt form generate takes (text is encoded
        with the model's tokenizer), stopping at the model's eos ids unless stop_tokens is given,
        and at the stop strings of stop; request i draws from random stream seed_index + i of
        sampling.seed; logprobs: see Batcher.add_request. Every argument is checked
        (ortspec.validation) before any work starts; sampling already was (validation.sampling)."""
        max_new_tokens = validation.max_new_tokens(max_new_tokens, minimum=min_new_tokens)
        stops = validation.stop_tokens(stop_tokens, self.manifest.spec.vocab_size, self.manifest.spec.eos_token_ids)
        stop, logprobs = validation.stop_strings(stop), validation.logprobs(logprobs)
        seed_index = validation.seed_index(seed_index)
        if stop and self.manifest.tokenizer_path is None:
            raise InputError(f"{self.manifest.dir} has no tokenizer.json, so stop strings cannot be matched on text; "
                             "pass stop_tokens (token ids) instead.")
        tokenizer = self.tokenizer if stop else None
        prompts, single, text = self.token_prompts(prompt)
        validation.prompts_fit(prompts, max_new_tokens, self.manifest.max_length, self.reserved)
        requests = [Request(row=i, prompt=p, max_new_tokens=max_new_tokens, stop_tokens=stops, sampling=sampling,
                            random=random_stream(sampling, seed_index + i), logprobs=logprobs,
                            stop_strings=StopStrings(tokenizer, stop) if stop else None)
                    for i, p in enumerate(prompts)]
        return NewRequests(requests, single, text)

    def token_prompts(self, prompt) -> tuple[list[list[int]], bool, bool]:
        """(prompts as token ids, single, text): text is encoded with the model's tokenizer;
        every form is checked (validation.token_prompts) before any work starts."""
        vocab = self.manifest.spec.vocab_size
        texts = validation.text_prompts(prompt)
        if texts is None:
            return *validation.token_prompts(prompt, vocab), False
        prompts, _ = validation.token_prompts([self.tokenizer.encode(t).ids for t in texts], vocab)
        return prompts, isinstance(prompt, str), True
