"""GET /openapi.json describes every route the app serves, and is a valid OpenAPI 3.1
document whose request bodies are the structs the handlers decode."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from services.gateway import openapi_rules, validation
from services.gateway.embeddings_api import EmbeddingBody
from services.gateway.errors import ApiError
from services.gateway.openai_responses.convert import responses_job
from services.gateway.openai_responses.protocol import ResponsesBody
from services.gateway.openapi import OPERATIONS, document
from services.gateway.protocol import (
    AbortBody,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
)
from tests.gateway.helpers import MODEL, Running


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


@pytest.mark.redis
async def test_every_route_is_described(gw: Running, http) -> None:
    async with http.get(f"{gw.url}/openapi.json") as r:
        assert r.status == 200 and r.content_type == "application/json"
        doc = await r.json()
    validate(doc)
    assert doc["openapi"] == "3.1.0"
    served = {
        (route.method.lower(), route.resource.canonical)
        for route in gw.runner.app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    described = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert served == described
    schemas = doc["components"]["schemas"]
    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in schemas, ref


# One valid body per struct: the struct and its schema must both take it, and both refuse it
# with an unknown field added.
EXAMPLES: dict[type, dict[str, Any]] = {
    CompletionBody: {"prompt": [1, 2], "n": 2, "response_format": {"type": "json_object"}},
    ChatBody: {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    GenerateBody: {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3}, "rid": ["x", "y"]},
    TokenizeBody: {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    DetokenizeBody: {"tokens": [1, 2, 3]},
    AbortBody: {"abort_all": True},
    ResponsesBody: {"input": [{"role": "user", "content": "hi"}], "instructions": "Be brief."},
    EmbeddingBody: {"input": ["a", [1, 2]], "encoding_format": "base64", "dimensions": 8},
}


def test_request_bodies_are_the_decoded_structs() -> None:
    doc = document()
    bodies = {op.body for op in OPERATIONS if op.body is not None}
    assert bodies == set(EXAMPLES)
    for op in OPERATIONS:
        if op.body is None:
            continue
        content = doc["paths"][op.path][op.method]["requestBody"]["content"]
        ref = content["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{op.body.__name__}"
        schema = Draft202012Validator({"$ref": ref, "components": doc["components"]})
        example = EXAMPLES[op.body]
        msgspec.json.decode(msgspec.json.encode(example), type=op.body)
        schema.validate(example)
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode({**example, "bogus": 1}), type=op.body)
        assert not schema.is_valid({**example, "bogus": 1})


# How each body with range rules reaches validation, and a minimal valid body around a field.
VALIDATE: dict[str, tuple[type, Any, Any]] = {
    "CompletionBody": (
        CompletionBody,
        lambda f, x: {"prompt": "hi", f: x},
        lambda b: validation.completion_jobs(b, MODEL),
    ),
    "ChatBody": (
        ChatBody,
        # top_logprobs needs logprobs on (a rule across fields, stated in its description)
        lambda f, x: {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, f: x},
        lambda b: validation.chat_job(b, MODEL),
    ),
    "ResponsesBody": (
        ResponsesBody,
        lambda f, x: {"input": "hi", f: x},
        lambda b: responses_job(b, MODEL),
    ),
    "NativeSamplingBody": (
        GenerateBody,
        lambda f, x: {"text": "hi", "sampling_params": {f: x}},
        validation.native_jobs,
    ),
    "GenerateBody": (GenerateBody, lambda f, x: {"text": "hi", f: x}, validation.native_jobs),
}


def _accepted(type_: type, body: Any, check: Any) -> bool:
    try:
        check(validation.decode(msgspec.json.encode(body), type_))
    except ApiError as e:
        assert e.status == 400
        return False
    return True


def test_the_documented_ranges_are_the_validated_ones() -> None:
    """Around every numeric bound the document states, the schema and validation agree on
    each value: the bound itself, one past it, and halfway (floats are refused where the
    field is an integer, by both)."""
    components = document()["components"]
    checked = 0
    for name, fields in openapi_rules.RULES.items():
        if name not in VALIDATE:
            continue
        type_, make, check = VALIDATE[name]
        for field_name, rule in fields.items():
            bounds = [rule[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in rule]
            schema = Draft202012Validator({**components["schemas"][name]["properties"][field_name]})
            for b in bounds:
                for x in (b - 1, b - 0.5, b, b + 0.5, b + 1):
                    if abs(x) >= 2**63 and isinstance(x, float):
                        continue  # a float that large is not a value anyone sends
                    said = schema.is_valid(x)
                    did = _accepted(type_, make(field_name, x), check)
                    assert said == did, (name, field_name, x, said, did)
                    checked += 1
    assert checked > 100


def test_roles_and_list_sizes_are_the_validated_ones() -> None:
    doc = document()["components"]["schemas"]
    assert doc["ChatMessageBody"]["properties"]["role"]["enum"] == list(
        validation.limits.CHAT_ROLES
    )
    chat = VALIDATE["ChatBody"]
    for role in (*validation.limits.CHAT_ROLES, "robot"):
        body = {"messages": [{"role": role, "content": "hi"}]}
        assert _accepted(chat[0], body, chat[2]) == (role in validation.limits.CHAT_ROLES)
    generate = VALIDATE["GenerateBody"]
    limit = doc["GenerateBody"]["properties"]["text"]["maxItems"]
    assert _accepted(generate[0], {"text": ["a"] * limit}, generate[2])
    assert not _accepted(generate[0], {"text": ["a"] * (limit + 1)}, generate[2])
    assert not _accepted(generate[0], {"text": []}, generate[2])
