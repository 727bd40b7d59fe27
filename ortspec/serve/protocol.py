"""The OpenAI wire format: request bodies checked into ``Completion``, and response bodies built.

Fields of /v1/completions and /v1/chat/completions that ortspec serves: prompt (a str, token
ids, or a list of one of those) or messages, max_tokens (default 16, as OpenAI), temperature
(default 0 = greedy: ortspec's default, where OpenAI's is 1), top_p, top_k (an extension, as
vLLM has it), seed, stream, stream_options.include_usage, n = 1, and the extension ``timeout``
(seconds; at most the server's --request-timeout). Fields that would change what is generated
and that ortspec cannot honour (stop strings, n > 1, logprobs, echo, penalties, best_of) are
refused with a 400 naming them, rather than ignored; other unknown fields are ignored, and a
field sent as null means its default. A body nested deeper than MAX_JSON_DEPTH is refused.
Each choice carries ``token_ids`` (an extension): the generated ids, also for models without a
tokenizer (whose ``text`` is then empty).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from .. import validation
from ..errors import InputError
from ..speculative.sampling import SamplingParams

UNSUPPORTED = {"stop": None, "n": 1, "logprobs": None, "top_logprobs": None, "echo": False, "best_of": 1,
               "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "suffix": None,
               "tools": None, "response_format": None}  # field -> the only value accepted
MAX_JSON_DEPTH = 32  # nested objects and arrays a body may hold (a chat body needs 3)


class HTTPError(Exception):
    """A request the server answers with ``status`` and this message."""

    status = 400


class BadRequest(HTTPError):
    """400: the body or a field is wrong."""


class TooLarge(HTTPError):
    """413: the body or the prompt is over the server's limit."""

    status = 413


class BodyTimeout(HTTPError):
    """408: the body did not arrive in time."""

    status = 408


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class Completion:
    """One checked request: what to generate and how to answer."""

    prompt: str | list[int] | None  # None for chat (messages instead)
    messages: list[dict] | None
    max_tokens: int
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    timeout: float
    chat: bool
    id: str = dataclasses.field(default_factory=new_id)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the body nests objects or arrays deeper than the JSON parser goes; at most "
                         f"{MAX_JSON_DEPTH} levels are accepted.") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise BadRequest(f"the body is not valid JSON ({exc}); send a JSON object such as "
                         '{"prompt": "def f(", "max_tokens": 16}.') from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body is a JSON {type(body).__name__}; send a JSON object.")
    if _depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(f"the body nests objects or arrays more than {MAX_JSON_DEPTH} levels deep; a request needs "
                         "at most 3.")
    return body


def _depth(value) -> int:
    """How deep objects and arrays nest in a parsed body (iterative: no recursion to run out of);
    stops counting past MAX_JSON_DEPTH."""
    deepest, todo = 0, [(value, 1)]
    while todo and deepest <= MAX_JSON_DEPTH:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def completion(body: dict, chat: bool, max_timeout: float, request_id: str | None = None) -> Completion:
    """Checks a /v1/completions (chat=False) or /v1/chat/completions body; BadRequest names the field."""
    body = {name: value for name, value in body.items() if value is not None}  # null: the default
    for name, accepted in UNSUPPORTED.items():
        if name in body and body[name] != accepted and not (accepted is None and body[name] in ([], "")):
            raise BadRequest(f"{name}={_short(body[name])} is not supported by ortspec serve; leave it out"
                             f"{'' if accepted is None else f' or send {accepted!r}'}.")
    if not isinstance(body.get("model", ""), str):
        raise BadRequest(f"model={_short(body['model'])} must be a string (the server serves one model, whatever the "
                         "name).")
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options={_short(options)} must be an object such as {{\"include_usage\": true}}.")
    try:
        sampling = validation.sampling(body.get("temperature", 0.0), body.get("top_k", 0), body.get("top_p", 1.0),
                                       body.get("seed"))
        max_tokens = validation.max_new_tokens(body.get("max_tokens", 16), minimum=1)
        stream = validation.flag("stream", body.get("stream", False))
        include_usage = validation.flag("stream_options.include_usage", options.get("include_usage", False))
    except InputError as exc:
        raise BadRequest(str(exc).replace("max_new_tokens", "max_tokens")) from None
    return Completion(prompt=None if chat else _prompt(body), messages=_messages(body) if chat else None,
                      max_tokens=max_tokens, sampling=sampling, stream=stream, include_usage=include_usage,
                      timeout=_timeout(body.get("timeout", max_timeout), max_timeout), chat=chat,
                      id=request_id or new_id())


def _prompt(body: dict) -> str | list[int]:
    if "prompt" not in body:
        raise BadRequest("the body has no 'prompt'; send the text (or token ids) to continue.")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(validation.is_integer(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt holds {len(prompt)} prompts; send one prompt per request.")
    raise BadRequest(f"prompt={_short(body['prompt'])} must be a non-empty string or a non-empty list of token ids.")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects.")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest(f"messages[{i}]={_short(m)} must be an object with a string 'role' and a string "
                             "'content'.")
    return messages


def _timeout(value, limit: float) -> float:
    if not validation.is_real(value) or not 0 < value <= limit:
        raise BadRequest(f"timeout={_short(value)} must be a number of seconds in (0, {limit:g}] (the server's "
                         "--request-timeout).")
    return float(value)


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- responses ----------------------------------------------------------------------------------
def error_body(message: str, status: int) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error", 408: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(req: Completion, text: str, token_ids: list[int], finish_reason: str | None, stream: bool) -> dict:
    if not req.chat:
        return {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}
    message = {"role": "assistant", "content": text}
    return {"index": 0, "delta" if stream else "message": message, "token_ids": token_ids, "logprobs": None,
            "finish_reason": finish_reason}


def response(req: Completion, model: str, text: str, token_ids: list[int], finish_reason: str,
             prompt_tokens: int) -> dict:
    return {"id": req.id, "object": "chat.completion" if req.chat else "text_completion", "created": req.created,
            "model": model, "choices": [_choice(req, text, token_ids, finish_reason, stream=False)],
            "usage": usage(prompt_tokens, len(token_ids))}


def chunk(req: Completion, model: str, text: str, token_ids: list[int], finish_reason: str | None = None,
          usage_counts: dict | None = None) -> str:
    """One server-sent event: a piece of the completion (usage_counts: the final usage-only chunk)."""
    body = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": req.created,
            "model": model, "choices": [] if usage_counts else [_choice(req, text, token_ids, finish_reason, True)]}
    if usage_counts:
        body["usage"] = usage_counts
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
