"""The OpenAI wire format: request bodies checked into ``Completion``, and response bodies built.

Fields of /v1/completions and /v1/chat/completions that ortspec serves: prompt (a str, token
ids, or a list of one of those) or messages (content a string or a list of text parts),
model (the served name or an alias; another is 404 model_not_found), max_tokens (chat also
max_completion_tokens; default 16, as OpenAI), temperature (default 0 = greedy: ortspec's
default, where OpenAI's is 1), top_p, top_k and min_p and ignore_eos (extensions, as vLLM has
them; ignore_eos: the model's stop tokens do not end a choice), seed, n (choices,
each a row of the batch; with a seed choice i draws random stream i), stop (up to 4 strings),
logprobs (completions: N alternatives; chat: a flag, with top_logprobs N), echo (completions),
stream, stream_options.include_usage, and the extension ``timeout`` (seconds; at most the
server's --request-timeout). Fields that would change what is generated and that ortspec
cannot honour (UNSUPPORTED: penalties, logit_bias, best_of > 1, ...) are refused with a 400
naming them, rather than ignored; other unknown fields are ignored, and a field sent as null
means its default. A body nested deeper than MAX_JSON_DEPTH, or holding NaN or Infinity (not
JSON, though Python's parser takes them), is refused. Each field's JSON type is checked here
(FIELD_TYPES), so that a message names JSON's types, not the Python API's. Each choice carries
``token_ids`` (an extension): the generated ids, also for models without a tokenizer (whose
``text`` is then empty); at a stop string they run to the token that completed it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import time
import uuid

from .. import validation
from ..errors import InputError
from ..speculative.sampling import SamplingParams

# field -> the values accepted: those that change nothing (the first is the one a message names;
# None: leave it out, or send it empty: [], "" or {})
UNSUPPORTED = {"best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
               "logit_bias": None, "suffix": None, "min_tokens": (0,),
               "tools": None, "functions": None,  # functions, function_call: tools, tool_choice's older names
               "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),  # with no tools both say: text
               "response_format": ({"type": "text"},)}
EMPTY = ([], "", {})
MAX_JSON_DEPTH = 32  # nested objects and arrays a body may hold (a chat body with text parts needs 5)
MAX_INT_DIGITS = 4300  # Python's int conversion limit (sys.get_int_max_str_digits' default)
MAX_STOPS, MAX_STOP_CHARS = 4, 1000  # stop strings a request may send (OpenAI's 4), characters in each
MAX_LOGPROBS = {False: 5, True: validation.MAX_LOGPROBS}  # chat -> the most alternatives per token (OpenAI's)
# field -> its JSON type, checked before the values go to ortspec.validation (whose messages name
# Python's types); logprobs and top_logprobs are _logprobs', n is _n's, timeout _timeout's
FIELD_TYPES = {"temperature": "number", "top_p": "number", "min_p": "number", "top_k": "integer",
               "seed": "integer", "max_tokens": "integer", "max_completion_tokens": "integer", "stream": "boolean",
               "echo": "boolean", "ignore_eos": "boolean"}
KINDS = {"number": "a number", "integer": "an integer", "boolean": "true or false"}


class HTTPError(Exception):
    """A request the server answers with ``status`` and this message (code, param: OpenAI's error fields)."""

    status, code, param = 400, None, None


class BadRequest(HTTPError):
    """400: the body or a field is wrong."""


class TooLarge(HTTPError):
    """413: the body or the prompt is over the server's limit."""

    status = 413


class BodyTimeout(HTTPError):
    """408: the body did not arrive in time."""

    status = 408


class ModelNotFound(HTTPError):
    """404: the body names a model this server does not serve."""

    status, code, param = 404, "model_not_found", "model"


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class Completion:
    """One checked request: what to generate and how to answer."""

    prompt: str | list[int] | None  # None for chat (messages instead)
    messages: list[dict] | None  # contents as strings
    max_tokens: int
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    timeout: float
    chat: bool
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # the alternatives to list with each token's log-probability; None: no logprobs
    echo: bool = False
    ignore_eos: bool = False  # vLLM's extension: the model's stop tokens do not end the choices
    id: str = dataclasses.field(default_factory=new_id)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def parse_json(raw: bytes) -> dict:
    if not raw.strip():
        raise BadRequest('the body is empty; send a JSON object such as {"prompt": "def f(", "max_tokens": 16}.')
    try:
        body = json.loads(raw, parse_constant=_not_json, parse_float=_finite)  # integers parsed in C: no callback
    except RecursionError:
        raise BadRequest(f"the body nests objects or arrays deeper than the JSON parser goes; at most "
                         f"{MAX_JSON_DEPTH} levels are accepted.") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's digit limit
        _too_many_digits(exc)
        raise BadRequest(f"the body is not valid JSON ({exc}); send a JSON object such as "
                         '{"prompt": "def f(", "max_tokens": 16}.') from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body is a JSON {_json_type(body)}; send a JSON object such as "
                         '{"prompt": "def f(", "max_tokens": 16} (one request per body).')
    if _depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(f"the body nests objects or arrays more than {MAX_JSON_DEPTH} levels deep; a request needs "
                         "at most 5.")
    return body


def _not_json(constant: str):
    """(json.loads' parse_constant) NaN, Infinity and -Infinity, which Python's parser takes and JSON has not."""
    raise BadRequest(f"the body holds {constant}, which is not JSON (its numbers are finite); send a number, or leave "
                     "the field out for its default.")


def _finite(text: str) -> float:
    """(json.loads' parse_float) A number beyond a double's range parses as infinity: refused, named as sent."""
    number = float(text)
    if math.isinf(number):
        raise BadRequest(f"the body holds the number {text[:40]}, beyond the largest this server parses (about "
                         "1.8e308); send a smaller number.")
    return number


def _too_many_digits(exc: ValueError) -> None:
    """An integer of more digits than Python converts (MAX_INT_DIGITS), refused naming its length,
    not in a ValueError naming sys.set_int_max_str_digits. (A parse_int callback would say it
    too, at a Python call for every integer: 4 million token ids cost seconds.)"""
    found = re.search(r"value has (\d+) digits", str(exc))
    if found and not isinstance(exc, json.JSONDecodeError):
        raise BadRequest(f"the body holds an integer of {found[1]} digits, more than this server parses "
                         f"({MAX_INT_DIGITS}); send a smaller number.") from None


def _json_type(value) -> str:
    """What JSON calls a parsed value's type."""
    if isinstance(value, bool):
        return "boolean"
    return {list: "array", str: "string", int: "number", float: "number", type(None): "null"}.get(type(value),
                                                                                                "object")


def _depth(value) -> int:
    """How deep objects and arrays nest in a parsed body (iterative: no recursion to run out of);
    stops counting past MAX_JSON_DEPTH."""
    deepest, todo = 0, [(value, 1)]
    while todo and deepest <= MAX_JSON_DEPTH:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        children = item.values() if type(item) is dict else item
        nested = itertools.compress(children, map(CONTAINERS.__contains__, map(type, children)))  # in C: no
        todo.extend(zip(nested, itertools.repeat(depth + 1)))  # Python step per token id of a long prompt
    return deepest


CONTAINERS = frozenset({dict, list})  # what json.loads makes of objects and arrays


def completion(body: dict, chat: bool, max_timeout: float, request_id: str | None = None, models: tuple = (),
               max_n: int = 1, max_ids: int | None = None) -> Completion:
    """Checks a /v1/completions (chat=False) or /v1/chat/completions body; BadRequest names the
    field. models: the names served (empty: any); max_n: the most choices (the batch's rows);
    max_ids: the model's max_length, past which a prompt of token ids gets 413 before its ids
    are checked one by one."""
    body = {name: value for name, value in body.items() if value is not None}  # null: the default
    for name, accepted in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], value) for value in accepted or EMPTY):
            raise BadRequest(f"{name}={_short(body[name])} is not supported by ortspec serve; leave it out"
                             f"{'' if accepted is None else f' or send {_short(accepted[0])}'}.")
    _model(body, models)
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options={_short(options)} must be an object such as {{\"include_usage\": true}}.")
    options = {name: value for name, value in options.items() if value is not None}  # null: the default here too
    for name, kind in [*FIELD_TYPES.items(), ("stream_options.include_usage", "boolean")]:
        value = options.get("include_usage") if name == "stream_options.include_usage" else body.get(name)
        if value is not None:
            _typed(name, value, kind)
    _stop_type(body.get("stop"))
    try:
        sampling = validation.sampling(body.get("temperature", 0.0), body.get("top_k", 0), body.get("top_p", 1.0),
                                       body.get("seed"), body.get("min_p", 0.0))
        ignore_eos = validation.flag("ignore_eos", body.get("ignore_eos", False))
        max_tokens = validation.max_new_tokens(_max_tokens(body, chat), minimum=1)
        stream = validation.flag("stream", body.get("stream", False))
        include_usage = validation.flag("stream_options.include_usage", options.get("include_usage", False))
        echo = validation.flag("echo", body.get("echo", False))
        stop = validation.stop_strings(body.get("stop"))
    except InputError as exc:
        raise refused(exc) from None
    logprobs = _logprobs(body, chat)
    _check_choices(chat, echo, logprobs, stop)
    return Completion(prompt=None if chat else _prompt(body, max_ids), messages=_messages(body) if chat else None,
                      max_tokens=max_tokens, sampling=sampling, stream=stream, include_usage=include_usage,
                      timeout=_timeout(body.get("timeout", max_timeout), max_timeout), chat=chat,
                      id=request_id or new_id(), n=_n(body.get("n", 1), max_n), stop=stop, logprobs=logprobs,
                      echo=echo, ignore_eos=ignore_eos)


def _typed(name: str, value, kind: str) -> None:
    """BadRequest unless value is of JSON type kind ("number", "integer": one without a fraction
    or exponent, within 64 bits, "boolean"), naming what was sent in JSON's words."""
    if kind == "boolean" and not isinstance(value, bool):
        raise BadRequest(f"{name}={_short(value)} must be true or false; got {_a_json_type(value)}.")
    if kind != "boolean" and not validation.is_real(value):
        raise BadRequest(f"{name}={_short(value)} must be {KINDS[kind]}; got {_a_json_type(value)}.")
    if kind == "integer" and not validation.is_integer(value):
        raise BadRequest(f"{name}={_short(value)} must be an integer, written without a fraction or exponent.")
    if kind == "integer" and value > validation.INT64_MAX:
        raise BadRequest(f"{name}={_short(value)} exceeds {validation.INT64_MAX}, the largest integer this server "
                         "takes (64 bits).")
    if name == "seed" and value < 0:
        raise BadRequest(f"seed={value} must be an integer >= 0; leave it out for a random seed.")


def _a_json_type(value) -> str:
    kind = _json_type(value)
    return "null" if kind == "null" else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _stop_type(value) -> None:
    """stop: a string, or an array of non-empty strings (validation.stop_strings checks their text)."""
    if value is None or isinstance(value, str) or value == []:
        return
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest(f"stop={_short(value)} must be a string or an array of non-empty strings: text that ends "
                         "the completion.")


def _same(value, accepted) -> bool:
    """value is accepted's JSON value: 1 and 1.0 alike, but not true for 1, nor [] for {}."""
    if validation.is_real(accepted):
        return validation.is_real(value) and value == accepted
    return type(value) is type(accepted) and value == accepted


def refused(exc: InputError) -> BadRequest:
    """The 400 for what the Python API's checks refused, in the body's words (max_tokens)."""
    return BadRequest(str(exc).replace("max_new_tokens", "max_tokens"))


def _model(body: dict, models: tuple) -> None:
    if "model" not in body:
        return
    if not isinstance(body["model"], str):
        raise BadRequest(f"model={_short(body['model'])} must be a string: the served model's name.")
    if models and body["model"] not in models:
        raise ModelNotFound(f"the model {_short(body['model'])} does not exist here; this server serves "
                            f"{' or '.join(map(json.dumps, models))} (GET /v1/models).")


def _max_tokens(body: dict, chat: bool):
    if chat and "max_completion_tokens" in body and "max_tokens" not in body:  # chat's newer name for it
        return body["max_completion_tokens"]
    return body.get("max_tokens", 16)


def _n(value, max_n: int) -> int:
    if not validation.is_integer(value) or not 1 <= value <= max_n:
        raise BadRequest(f"n={_short(value)} must be an integer in [1, {max_n}]: each choice takes a row of this "
                         "server's batch (at most --max-batch-size, and --max-queue, choices).")
    return int(value)


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives to list with each token's log-probability, or None (no logprobs)."""
    limit = MAX_LOGPROBS[chat]
    if not chat:
        if "top_logprobs" in body:
            raise BadRequest("top_logprobs is a /v1/chat/completions field; /v1/completions takes logprobs=N "
                             f"(N alternatives, 0..{limit}).")
        value, name = body.get("logprobs"), "logprobs"
    else:
        asked = body.get("logprobs", False)
        if not isinstance(asked, bool):
            raise BadRequest(f"logprobs={_short(asked)} must be true or false (top_logprobs=N lists N alternatives).")
        if not asked:
            if "top_logprobs" in body:
                raise BadRequest("top_logprobs needs logprobs: true.")
            return None
        value, name = body.get("top_logprobs", 0), "top_logprobs"
    if value is not None and not (validation.is_integer(value) and 0 <= value <= limit):
        raise BadRequest(f"{name}={_short(value)} must be an integer in [0, {limit}]: the most probable tokens to "
                         "list beside each token's log-probability.")
    return None if value is None else int(value)


def _check_choices(chat: bool, echo: bool, logprobs: int | None, stop: tuple[str, ...]) -> None:
    if echo and chat:
        raise BadRequest("echo is a /v1/completions field; leave it out of a chat completion.")
    if echo and logprobs is not None:
        raise BadRequest("echo with logprobs (the prompt's log-probabilities) is not supported; send one of them.")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"stop={_short(list(stop))} must hold at most {MAX_STOPS} strings of at most "
                         f"{MAX_STOP_CHARS} characters each.")


def _prompt(body: dict, max_ids: int | None = None) -> str | list[int]:
    if "prompt" not in body:
        raise BadRequest('the body has no "prompt"; send the text (or an array of token ids) to continue.')
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and max_ids is not None and len(prompt) > max_ids:
        raise TooLarge(f"prompt holds {len(prompt)} token ids, more than the model's max_length ({max_ids}) holds; "
                       "send a shorter prompt.")
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(validation.is_integer(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt holds {len(prompt)} prompts; send one prompt per request.")
    raise BadRequest(f"prompt={_short(body['prompt'])} must be a non-empty string or a non-empty array of token ids "
                     "(integers).")


def _messages(body: dict) -> list[dict]:
    """The messages with each content as one string (text parts joined by newlines, as vLLM does)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array of {\"role\": ..., \"content\": ...} objects.")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))):
            raise BadRequest(f'messages[{i}]={_short(m)} must be an object with a string "role" and a "content": a '
                             "string or an array of text parts.")
    messages = [{**m, "content": _content(m["content"], i)} for i, m in enumerate(messages)]
    try:  # named here: once rendered, only the prompt's position would tell which message holds it
        for i, m in enumerate(messages):
            validation.unicode_text(f"messages[{i}].role", m["role"])
            validation.unicode_text(f"messages[{i}].content", m["content"])
    except InputError as exc:
        raise BadRequest(str(exc)) from None
    return messages


def _content(content: str | list, i: int) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise BadRequest(f"messages[{i}].content[{j}] has type {_short(kind)}; ortspec serve takes text parts "
                             "only: {\"type\": \"text\", \"text\": ...}.")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"messages[{i}].content[{j}].text={_short(part.get('text'))} must be a string.")
    return "\n".join(part["text"] for part in content)


def _timeout(value, limit: float) -> float:
    if not validation.is_real(value) or not 0 < value <= limit:
        raise BadRequest(f"timeout={_short(value)} must be a number of seconds in (0, {limit:g}] (the server's "
                         "--request-timeout).")
    return float(value)


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- responses ----------------------------------------------------------------------------------
def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
            408: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_error",
            431: "invalid_request_error"}.get(status, "server_error")
    if code == ModelNotFound.code:
        kind = "invalid_request_error"  # as OpenAI answers an unknown model
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(req: Completion, index: int, text: str, token_ids: list[int], finish_reason: str | None,
           logprobs: dict | None = None, stream: bool = False) -> dict:
    """One choice (stream: of a chunk, its text a piece); logprobs in the route's shape (logprobs.py)."""
    if not req.chat:
        return {"index": index, "text": text, "token_ids": token_ids, "logprobs": logprobs,
                "finish_reason": finish_reason}
    message = {"role": "assistant", "content": text}
    return {"index": index, "delta" if stream else "message": message, "token_ids": token_ids, "logprobs": logprobs,
            "finish_reason": finish_reason}


def response(req: Completion, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": req.id, "object": "chat.completion" if req.chat else "text_completion", "created": req.created,
            "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chunk(req: Completion, model: str, choices: list[dict], usage_counts: dict | None = None) -> str:
    """One server-sent event: pieces of the choices (usage_counts: the final usage-only chunk)."""
    body = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": req.created,
            "model": model, "choices": choices}
    if usage_counts:
        body["usage"] = usage_counts
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
