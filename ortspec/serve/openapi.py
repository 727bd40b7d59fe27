"""The OpenAPI 3.1 description of ortspec serve's routes, served at GET /openapi.json.

Written by hand from protocol.py's checks (the fields, their types and ranges), so that a
client generator or a schema fuzzer (tests/test_fuzz_server.py) sees what the server accepts;
fields the server refuses (stop strings, n > 1, logprobs, ...) are left out. Every error
answer has the OpenAI error body (ErrorBody).
"""

from __future__ import annotations

ERRORS = {
    "400": "a field or the body is wrong (the message names it)",
    "408": "the body did not arrive within --body-timeout",
    "413": "the body is over --max-body-bytes, or a text over --max-prompt-chars",
    "429": "every queue slot is taken (--max-queue)",
    "500": "an internal error; the message names the request id that the server log files its traceback under",
    "503": "the request waited past its timeout for a row, or the server is stopping",
}

TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1, "default": 16},
    "temperature": {"type": "number", "minimum": 0, "default": 0,
                    "description": "0 is greedy (ortspec's default); else >= 1e-4"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1, "default": 0,
              "description": "0, or the vocabulary size or more, keeps every token"},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "timeout": {"type": "number", "exclusiveMinimum": 0, "description": "seconds, at most --request-timeout"},
    "n": {"const": 1},
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, TOKEN_IDS,
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                             {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 1}]},
        "model": {"type": "string"},
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
        "model": {"type": "string"},
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


def _post(summary: str, request: str) -> dict:
    responses = {"200": {"description": "the completion, or server-sent events with stream: true", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
        "text/event-stream": {"schema": {"type": "string"}}}}}
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
        "/v1/completions": _post("prompt -> completion", "CompletionRequest"),
    }
    if chat:
        paths["/v1/chat/completions"] = _post("messages -> completion", "ChatCompletionRequest")
    return {"openapi": "3.1.0", "info": {"title": f"ortspec serve: {model}", "version": "1"}, "paths": paths,
            "components": {"schemas": {"CompletionRequest": COMPLETION_REQUEST, "ChatCompletionRequest": CHAT_REQUEST,
                                       "Completion": COMPLETION, "ErrorBody": ERROR_BODY}}}
