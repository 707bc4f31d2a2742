"""The Responses API through every service, with the openai client's own calls: a plain
answer equal to the chat endpoint's, the streamed events assembling the same text, and a
`text.format` JSON schema enforced by the grammar service."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_control_endpoints import MODEL

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_responses_match_chat_and_stream_the_same(tiny_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input="hi", max_output_tokens=8, temperature=0
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == "incomplete"  # at max_output_tokens
    # streamed: the same text, ending with response.incomplete (as OpenAI's API does)
    events = list(
        client.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input="hi",
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    tiny_stack.wait_idle()


def test_the_stream_helper_assembles_a_completed_response(tiny_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    fmt: Any = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}}
    deltas = []
    with client.responses.stream(
        model=MODEL,
        input="a person, please (0)",
        max_output_tokens=48,
        text=fmt,
        extra_body={"seed": 0},  # as the schema test's first request: it completes
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


def test_text_format_json_schema_is_enforced(tiny_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    for seed in range(3):
        r = client.responses.create(
            model=MODEL,
            input=f"a person, please ({seed})",
            max_output_tokens=48,
            text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}},
            extra_body={"seed": seed},
        )
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
