"""The OpenAPI 3.1 description of ortspec serve's routes, served at GET /openapi.json.

Written by hand from protocol.py's checks (the fields, their types and ranges), so that a
client generator or a schema fuzzer (tests/test_fuzz_openapi.py) sees what the server accepts;
fields the server refuses (penalties, logit_bias, best_of > 1, ...) are left out, and a field
sent as null means its default. Some limits no schema can say (a prompt's length in tokens,
token ids within the vocabulary, temperature 0 or >= 1e-4, top_logprobs without logprobs,
echo with logprobs) are refused with 400 as well. Every error answer has the OpenAI error
body (ErrorBody).
"""

from __future__ import annotations

import numpy as np

from .protocol import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOPS

FLOAT32_MAX = float(np.finfo(np.float32).max)  # validation.sampling: finite as a float32
FLOAT32_TINY = float(np.finfo(np.float32).smallest_subnormal)  # the smallest top_p that is not 0 in float32

ERRORS = {
    "400": "a field or the body is wrong (the message names it)",
    "404": "the body's model is not served here (code model_not_found)",
    "408": "the body did not arrive within --body-timeout",
    "413": "the body is over --max-body-bytes, or a text over --max-prompt-chars",
    "429": "every queue slot is taken (--max-queue)",
    "500": "an internal error; the message names the request id that the server log files its traceback under",
    "503": "the request waited past its timeout for a row, or the server is stopping",
}

TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

FIELDS = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1, "default": 16},
    "temperature": {"anyOf": [{"const": 0}, {"type": "number", "minimum": 1e-4, "maximum": FLOAT32_MAX}],
                    "default": 0, "description": "0 is greedy (ortspec's default)"},
    "top_p": {"type": "number", "minimum": FLOAT32_TINY, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1, "default": 0,
              "description": "0, or the vocabulary size or more, keeps every token"},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1,
             "description": "choice i draws random stream i of the seed"},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": ["boolean", "null"]}}},
    "timeout": {"type": "number", "exclusiveMinimum": 0, "description": "seconds, at most --request-timeout"},
    "stop": {"anyOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                       {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                        "maxItems": MAX_STOPS}],
             "description": "text that ends a choice (left out of its text), matched across tokens"},
}
COMPLETION_FIELDS = {
    "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS[False],
                 "description": "each token's log-probability and this many alternatives"},
    "echo": {"type": "boolean", "default": False, "description": "the prompt's text before the completion's"},
}
CHAT_FIELDS = {
    "logprobs": {"type": "boolean", "default": False},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS[True],
                     "description": "alternatives per token; needs logprobs: true"},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


def _nullable(fields: dict) -> dict:
    return {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in fields.items()}  # null: the default


def _fields(models: tuple, max_n: int, route: dict) -> dict:
    served = {"model": {"enum": list(models), "description": "the served model's name or an alias"},
              "n": {"type": "integer", "minimum": 1, "maximum": max_n, "default": 1,
                    "description": "choices, each a row of the batch (--max-batch-size)"}}
    return _nullable({**FIELDS, **route, **served})


def completion_request(models: tuple, max_n: int) -> dict:
    prompt = {"oneOf": [{"type": "string", "minLength": 1}, TOKEN_IDS,
                        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                        {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 1}]}
    return {"type": "object", "required": ["prompt"],
            "properties": {"prompt": prompt, **_fields(models, max_n, COMPLETION_FIELDS)}}


def chat_request(models: tuple, max_n: int) -> dict:
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}
    messages = {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"], "properties": {"role": {"type": "string"},
                                                                         "content": content}}}
    return {"type": "object", "required": ["messages"],
            "properties": {"messages": messages, **_fields(models, max_n, CHAT_FIELDS)}}


ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["integer", "string"], "description": "the status, or OpenAI's code (model_not_found)"}}}},
}

CHOICE = {"type": "object", "required": ["index", "token_ids", "finish_reason"], "properties": {
    "index": {"type": "integer"}, "text": {"type": "string"}, "token_ids": {"type": "array", "items": {"type": "integer"}},
    "message": {"type": "object"}, "logprobs": {"type": ["object", "null"]},
    "finish_reason": {"enum": ["stop", "length", "timeout"]}}}

COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                   "model": {"type": "string"}, "choices": {"type": "array", "items": CHOICE, "minItems": 1},
                   "usage": {"type": "object"}},
}


EVENT = {  # one server-sent event (not JSON itself: the last one's data is [DONE])
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string",
                            "description": "a JSON chunk, a JSON error body (the last event), or [DONE]"}},
}


def _post(summary: str, request: str) -> dict:
    responses = {"200": {"description": "the completion, or server-sent events with stream: true", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
        "text/event-stream": {"schema": {"$ref": "#/components/schemas/Event"}}}}}
    responses.update({status: {"description": why, "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}} for status, why in ERRORS.items()})
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}}, "responses": responses}}


def _get(summary: str, media: str = "application/json") -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary, "content": {
        media: {"schema": {"type": "string"} if media != "application/json" else {"type": "object"}}}}}}}


def description(models: tuple, chat: bool, max_n: int) -> dict:
    """The OpenAPI document for a server of models[0] (its aliases after it; /v1/chat/completions
    only with a chat template) whose requests may ask up to max_n choices."""
    paths = {
        "/health": _get("ok, or 503 once the engine failed"),
        "/metrics": _get("Prometheus text", "text/plain"),
        "/v1/models": _get("the one model served"),
        "/openapi.json": _get("this description"),
        "/v1/completions": _post("prompt -> completion", "CompletionRequest"),
    }
    if chat:
        paths["/v1/chat/completions"] = _post("messages -> completion", "ChatCompletionRequest")
    schemas = {"CompletionRequest": completion_request(models, max_n),
               "ChatCompletionRequest": chat_request(models, max_n),
               "Completion": COMPLETION, "ErrorBody": ERROR_BODY, "Event": EVENT}
    return {"openapi": "3.1.0", "info": {"title": f"ortspec serve: {models[0]}", "version": "1"}, "paths": paths,
            "components": {"schemas": schemas}}
