"""The OpenAPI 3.1 description of ortspec serve's routes, served at GET /openapi.json.

Written by hand from protocol.py's checks (the fields, their types and ranges), so that a
client generator or a schema fuzzer (tests/test_fuzz_server.py) sees what the server accepts;
fields the server refuses (stop strings, n > 1, logprobs, ...) are left out, and a field sent
as null means its default. Some limits no schema can say (a prompt's length in tokens, token
ids within the vocabulary, temperature 0 or >= 1e-4) are refused with 400 as well. Every error
answer has the OpenAI error body (ErrorBody).
"""

from __future__ import annotations

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)  # validation.sampling: finite as a float32
FLOAT32_TINY = float(np.finfo(np.float32).smallest_subnormal)  # the smallest top_p that is not 0 in float32

ERRORS = {
    "400": "a field or the body is wrong (the message names it)",
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
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "timeout": {"type": "number", "exclusiveMinimum": 0, "description": "seconds, at most --request-timeout"},
    "n": {"const": 1},
    "model": {"type": "string", "description": "any: the server serves one model"},
}
SAMPLING = {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in FIELDS.items()}  # null: the default

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, TOKEN_IDS,
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                             {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 1}]},
        **SAMPLING,
    },
}

CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}},
        **SAMPLING,
    },
}

ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "null"},
        "code": {"type": "integer"}}}},
}

CHOICE = {"type": "object", "required": ["index", "token_ids", "finish_reason"], "properties": {
    "index": {"type": "integer"}, "text": {"type": "string"}, "token_ids": {"type": "array", "items": {"type": "integer"}},
    "message": {"type": "object"}, "finish_reason": {"enum": ["stop", "length", "timeout"]}}}

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


def description(model: str, chat: bool) -> dict:
    """The OpenAPI document for a server of `model` (/v1/chat/completions only with a chat template)."""
    paths = {
        "/health": _get("ok, or 503 once the engine failed"),
        "/metrics": _get("Prometheus text", "text/plain"),
        "/v1/models": _get("the one model served"),
        "/openapi.json": _get("this description"),
        "/v1/completions": _post("prompt -> completion", "CompletionRequest"),
    }
    if chat:
        paths["/v1/chat/completions"] = _post("messages -> completion", "ChatCompletionRequest")
    return {"openapi": "3.1.0", "info": {"title": f"ortspec serve: {model}", "version": "1"}, "paths": paths,
            "components": {"schemas": {"CompletionRequest": COMPLETION_REQUEST, "ChatCompletionRequest": CHAT_REQUEST,
                                       "Completion": COMPLETION, "ErrorBody": ERROR_BODY, "Event": EVENT}}}
