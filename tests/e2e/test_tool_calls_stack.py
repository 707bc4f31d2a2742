"""Tool calls constrained by the grammar through every service: with tool_choice "required"
or a named function, a random model's sampled calls always name a given tool and carry
arguments valid against its schema (valid by construction, whatever the model)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_control_endpoints import MODEL

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
SEEDS = range(8)


def test_required_and_named_calls_always_validate(tiny_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "weather or time?"}]
    named: Any = {"type": "function", "function": {"name": "clock"}}
    for seed in SEEDS:
        for choice in ("required", named):
            r = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=[WEATHER, CLOCK],
                tool_choice=choice,
                # one call at most: a random model left to list calls may not stop in time
                parallel_tool_calls=False,
                max_tokens=256,
                seed=seed,
            )
            out = r.choices[0]
            assert out.finish_reason == "tool_calls", (seed, choice, out)
            calls: list[Any] = list(out.message.tool_calls or [])
            assert calls, (seed, choice)
            for call in calls:
                name = call.function.name
                assert name in SCHEMAS and (choice == "required" or name == "clock")
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
    tiny_stack.wait_idle()


def test_a_named_call_streams_its_arguments(tiny_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    named: Any = {"type": "function", "function": {"name": "weather"}}
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER],
            tool_choice=named,
            max_tokens=96,
            seed=3,
            stream=True,
        )
    )
    entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    assert entries[0].id and entries[0].function and entries[0].function.name == "weather"
    arguments = "".join((e.function.arguments or "") for e in entries if e.function)
    jsonschema.validate(json.loads(arguments), SCHEMAS["weather"])
    assert len(entries) > 2  # the arguments came in pieces, as they were generated
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
