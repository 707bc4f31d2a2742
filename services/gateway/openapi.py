"""GET /openapi.json: an OpenAPI 3.1 description of the HTTP API.

Request bodies are the JSON Schema of the msgspec structs the handlers decode (protocol.py),
so the document cannot drift from what the gateway accepts; the operations and their prose
are written here (a test checks that every route the app serves is listed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from aiohttp import web

from services.gateway import openapi_rules
from services.gateway.access_policy import ADMIN_PATHS, BUDGETED_PATHS, OPEN_PATHS
from services.gateway.embeddings_api import EmbeddingBody
from services.gateway.openai_responses.protocol import ResponsesBody
from services.gateway.protocol import (
    AbortBody,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
)

REF = "#/components/schemas/{name}"
ERROR = {"$ref": REF.format(name="Error")}
# The body of every error response (errors.py error_body), OpenAI's shape.
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    ok: str  # what a 200 answers
    body: type | None = None  # the request body's struct
    errors: dict[int, str] = field(default_factory=dict)
    streams: bool = False  # answers Server-Sent Events when the body asks (`stream`)
    content_type: str = "application/json"  # of a 200


BAD = {400: "invalid input; `error.param` names the field"}
BUSY = {
    503: "queue full, no live executor, the bus unreachable, or the server still starting",
    504: "timed out",
}
STARTING_OR_BUS = "the bus is unreachable, or the server is still starting"
UNKNOWN_MODEL = {404: "`model` names a model this server does not serve"}
OPERATIONS = [
    Operation(
        "post",
        "/v1/completions",
        "OpenAI completions",
        "a completion, or SSE chunks ending with `data: [DONE]`",
        CompletionBody,
        {**BAD, **UNKNOWN_MODEL, **BUSY},
        streams=True,
    ),
    Operation(
        "post",
        "/v1/chat/completions",
        "OpenAI chat completions, through the model's chat template",
        "a chat completion, or SSE chunks ending with `data: [DONE]`",
        ChatBody,
        {**BAD, **UNKNOWN_MODEL, **BUSY},
        streams=True,
    ),
    Operation(
        "post",
        "/v1/responses",
        "OpenAI Responses API, stateless (previous_response_id is refused; nothing is stored), "
        "with function tools",
        "a Response, or SSE Responses events (`event:` and `data:`) ending with response.completed",
        ResponsesBody,
        {**BAD, **UNKNOWN_MODEL, **BUSY},
        streams=True,
    ),
    Operation(
        "post",
        "/v1/embeddings",
        "OpenAI embeddings of strings or token ids (a server started with --is-embedding)",
        "a list of embeddings (floats, or base64 of float32 little-endian) with usage",
        EmbeddingBody,
        {**BAD, **UNKNOWN_MODEL, **BUSY},
    ),
    Operation("get", "/v1/models", "the served model (OpenAI list)", "a model list"),
    Operation(
        "get", "/v1/models/{model}", "one model (OpenAI)", "a model card", None, {404: "not served"}
    ),
    Operation(
        "post",
        "/generate",
        "SGLang's native generation: text or token ids in, text and token ids out",
        "one object, or a list for a batch or n > 1; SSE when streaming",
        GenerateBody,
        {**BAD, **BUSY},
        streams=True,
    ),
    Operation(
        "post",
        "/abort_request",
        "abort a request (any gateway's) by rid, or every request in flight here",
        '`{"aborted": [rid, ...]}`; the aborted calls end with finish reason "abort"',
        AbortBody,
        {**BAD, 404: "no gateway has this rid in flight", 503: "the bus is unreachable"},
    ),
    Operation(
        "post",
        "/tokenize",
        "the token ids of a text, or of chat messages through the chat template",
        '`{"tokens": [...], "count": N, "max_model_len": M}`',
        TokenizeBody,
        {**BAD, **UNKNOWN_MODEL, 503: STARTING_OR_BUS, 504: "no tokenizer answered"},
    ),
    Operation(
        "post",
        "/detokenize",
        "the text of token ids",
        '`{"text": "..."}`',
        DetokenizeBody,
        {**BAD, **UNKNOWN_MODEL, 503: STARTING_OR_BUS, 504: "no tokenizer answered"},
    ),
    Operation(
        "get",
        "/get_model_info",
        "the served model: path, name, context length, architecture, vocabulary",
        "the model's description; fields no live service can tell are null",
        errors={503: "redis is unreachable"},
    ),
    Operation(
        "get",
        "/get_server_info",
        "this gateway's settings, every live service instance, the executors' load",
        "the server's description",
        errors={503: "redis is unreachable"},
    ),
    Operation(
        "get",
        "/get_load",
        "SGLang's load report: per executor (data-parallel rank), requests and KV tokens",
        '`[{"dp_rank": 0, "num_reqs": N, "num_waiting_reqs": W, "num_tokens": T}, ...]`',
        errors={503: "redis is unreachable"},
    ),
    Operation(
        "get",
        "/v1/loads",
        "SGLang's newer load report (SMG's HTTP mode polls it): per-rank loads and their "
        "aggregate; `?dp_rank=N`, `?include=core,memory,queues,...`",
        '`{"timestamp", "version", "dp_rank_count", "loads": [...], "aggregate": {...}}`',
        errors={400: "a bad dp_rank, include or format", 503: "redis is unreachable"},
    ),
    Operation(
        "get",
        "/model_info",
        "the same as /get_model_info (SGLang's newer name)",
        "the model's description",
        errors={503: "redis is unreachable"},
    ),
    Operation(
        "get",
        "/server_info",
        "the same as /get_server_info (SGLang's newer name)",
        "the server's description",
        errors={503: "redis is unreachable"},
    ),
    Operation("get", "/version", "radixserve's version", '`{"version": "..."}`'),
    Operation(
        "get",
        "/health",
        "a request can be served end to end now: every stage has a fresh heartbeat",
        '`{"status": "ok", ...}`',
        errors={503: "a stage is missing (named in `missing`, with `reasons`), or no redis"},
    ),
    Operation(
        "get",
        "/metrics",
        "Prometheus metrics of this gateway, and the gauges of executors without a "
        "--metrics-port of their own (every service serves its own on --metrics-port)",
        "Prometheus text exposition format",
        content_type="text/plain",
    ),
    *(
        Operation(
            method,
            "/health_generate",
            "one greedy token through every service",
            '`{"status": "ok", "latency_s": ...}`',
            errors={503: "the probe failed or timed out"},
        )
        for method in ("get", "post")
    ),
    Operation(
        "post",
        "/flush_cache",
        "empty every executor's prefix cache",
        "the cache is empty",
        errors={
            400: "requests are queued or running",
            409: "requests arrived meanwhile",
            503: "no executor is alive, or the bus is unreachable",
        },
    ),
    Operation("get", "/openapi.json", "this document", "the OpenAPI document"),
]

PROMPT_BODIES = (CompletionBody, ChatBody, GenerateBody, TokenizeBody)
_PARAM = re.compile(r"\{(\w+)\}")


def access_errors(op: Operation) -> dict[int, str]:
    """What services/gateway/access_policy.py answers before the handler runs."""
    errors = {403: "a cross-site browser request (`Sec-Fetch-Site: cross-site`)"}
    if op.path in OPEN_PATHS:
        return errors
    if op.path in ADMIN_PATHS:
        errors[401] = "no valid key where `--api-key` or `--admin-api-key` is set"
        errors[403] += "; or a key that is not an admin key"
    else:
        errors[401] = "no valid key where `--api-key` is set"
    if op.method == "post":
        errors[415] = "a body not declared `Content-Type: application/json`"
    if op.path in BUDGETED_PATHS:
        errors[429] = "the key's `--max-inflight-per-key` calls are in flight; see Retry-After"
    return errors


def input_errors(op: Operation) -> dict[int, str]:
    """What every POST may meet before its handler: input_limits.py and the drain."""
    if op.method != "post":
        return {}
    errors = {
        413: "the body is larger than `--max-request-bytes`",
        503: "the gateway is shutting down",
    }
    if op.body is not None:
        errors[400] = "the body is not JSON, not UTF-8, or nests too deeply"
    if op.body in PROMPT_BODIES:
        errors[400] += "; or a prompt longer than `--max-prompt-chars` characters"
    return errors


def _errors(op: Operation) -> dict[int, str]:
    """Each status with every reason for it, the route's own first."""
    merged: dict[int, str] = {}
    for source in (op.errors, access_errors(op), input_errors(op)):
        for status, why in source.items():
            merged[status] = f"{merged[status]}; or {why}" if status in merged else why
    return merged


def _operation(op: Operation, body_ref: dict[str, Any] | None) -> dict[str, Any]:
    ok: dict[str, Any] = {op.content_type: {}}
    if op.streams:
        ok["text/event-stream"] = {}
    out: dict[str, Any] = {
        "summary": op.summary,
        "operationId": re.sub(r"\W+", "_", f"{op.method}_{op.path.strip('/')}").strip("_"),
        "responses": {
            "200": {"description": op.ok, "content": ok},
            **{
                str(status): {
                    "description": why,
                    "content": {"application/json": {"schema": ERROR}},
                }
                for status, why in sorted(_errors(op).items())
            },
        },
    }
    if op.path not in OPEN_PATHS:
        out["security"] = [{"bearer": []}, {}]  # {}: no key needed on a server without keys
    params = _PARAM.findall(op.path)
    if params:
        out["parameters"] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in params
        ]
    if body_ref is not None:
        out["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body_ref}},
        }
    return out


def document() -> dict[str, Any]:
    bodies = list(dict.fromkeys(op.body for op in OPERATIONS if op.body is not None))
    refs, schemas = msgspec.json.schema_components(bodies, ref_template=REF)
    ref_of = dict(zip(bodies, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        ref = ref_of[op.body] if op.body is not None else None
        paths.setdefault(op.path, {})[op.method] = _operation(op, ref)
    try:
        release = version("radixserve")
    except PackageNotFoundError:  # running from a checkout that was never installed
        release = "0+unknown"
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "radixserve",
            "version": release,
            "description": "OpenAI-compatible and SGLang-style native endpoints.",
        },
        "paths": paths,
        "components": {
            "schemas": {**openapi_rules.apply(schemas), "Error": ERROR_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def add_routes(app: web.Application) -> None:
    body = msgspec.json.encode(document())  # built once: it depends on nothing at runtime

    async def openapi_json(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    app.router.add_get("/openapi.json", openapi_json)
