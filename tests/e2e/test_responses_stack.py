"""The Responses API through every service, with the openai client's own calls: a plain
answer equal to the chat endpoint's, the streamed events assembling the same text, a
`text.format` JSON schema enforced by the grammar service, and function tools: calls whose
arguments the grammar keeps valid (whole and streamed), and the tool loop's second turn."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_control_endpoints import MODEL
from tests.e2e.test_tool_calls_stack import CLOCK as CHAT_CLOCK
from tests.e2e.test_tool_calls_stack import WEATHER as CHAT_WEATHER

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


# -- function tools: calls constrained by the grammar, as chat completions' ----------------------
# The chat tests' tools in the Responses shape (flat: the function's fields beside "type").
WEATHER: Any = {"type": "function", **CHAT_WEATHER["function"], "strict": True}
CLOCK: Any = {"type": "function", **CHAT_CLOCK["function"], "strict": True}
TOOL_SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, CLOCK)}


def test_named_and_required_function_calls_validate(tiny_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    named: Any = {"type": "function", "name": "clock"}
    for seed in range(3):
        for choice in (named, "required"):
            r = client.responses.create(
                model=MODEL,
                input="weather or time?",
                tools=[WEATHER, CLOCK],
                tool_choice=choice,
                parallel_tool_calls=False,  # one call: a random model may not stop listing
                max_output_tokens=256,
                extra_body={"seed": seed},
            )
            assert r.status == "completed", (seed, choice, r.output)
            calls: list[Any] = [item for item in r.output if item.type == "function_call"]
            assert len(calls) == 1 and len(r.output) == 1, (seed, choice, r.output)
            call = calls[0]
            assert call.id.startswith("fc_") and call.call_id.startswith("call_")
            assert call.status == "completed"
            assert call.name in TOOL_SCHEMAS and (choice == "required" or call.name == "clock")
            jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS[call.name])
    tiny_stack.wait_idle()


def test_the_stream_helper_yields_the_function_call_events(tiny_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    events: list[Any] = []
    with client.responses.stream(
        model=MODEL,
        input="weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=96,
        extra_body={"seed": 3},
    ) as stream:
        events.extend(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.name == "weather"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2  # the arguments came in pieces, as they were generated
    assert {(e.item_id, e.output_index) for e in deltas} == {(added.id, 0)}
    arguments = "".join(e.delta for e in deltas)
    assert events[-3].arguments == done.arguments == arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (call,) = final.output
    assert call.type == "function_call" and call.id == added.id and call.call_id == added.call_id
    assert final.status == "completed" and call.arguments == arguments
    jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS["weather"])


def test_a_second_turn_takes_the_call_and_its_output(tiny_stack: Stack) -> None:
    """The tool loop: the call and its output go back as input items, and the model answers
    from the same prompt as chat completions' assistant tool_calls and tool message."""
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    items: Any = [{"role": "user", "content": "weather in Oslo?"}]
    first = client.responses.create(
        model=MODEL,
        input=items,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=96,
        extra_body={"seed": 1},
    )
    call: Any = first.output[-1]
    assert call.type == "function_call" and first.status == "completed"
    items += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
    ]
    r = client.responses.create(
        model=MODEL,
        input=items,
        tools=[WEATHER],
        max_output_tokens=8,
        temperature=0,
        tool_choice="none",
    )
    assert [item.type for item in r.output] == ["message"]
    assert r.usage is not None and first.usage is not None
    assert r.usage.input_tokens > first.usage.input_tokens  # the call and its output are in
    # the same conversation as chat completions writes it
    chat_call = {"name": "weather", "arguments": call.arguments}
    messages: Any = [
        items[0],
        {
            "role": "assistant",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": chat_call}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."},
    ]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[CHAT_WEATHER],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert chat.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    tiny_stack.wait_idle()
