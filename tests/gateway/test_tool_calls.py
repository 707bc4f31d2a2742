"""Tool calling in chat completions through the gateway (the fake backend plays the model):
tools and earlier calls reach the template, tool_choice required and named constrain the
output to the tools' schemas, auto reads the --tool-call-parser format, and the openai
client's own tool loop works, plain and streamed."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from services.gateway.tool_render import cut_array_calls
from shared.messages.common import JsonSchemaConstraint
from shared.messages.tokenize import ChatPrompt
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import MODEL, Running

StartGateway = Callable[..., Awaitable[Running]]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: Any = {"type": "function", "function": {"name": "time"}}


def client(gw: Running) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)


def user(text: str) -> Any:
    return [{"role": "user", "content": text}]


async def streamed(gw: Running, **kwargs: Any) -> tuple[str, dict[int, dict[str, str]], str]:
    """(content, index -> {"id", "name", "arguments"}, finish_reason) of a streamed answer."""
    content, finish = "", ""
    calls: dict[int, dict[str, str]] = {}
    stream = await client(gw).chat.completions.create(model=MODEL, stream=True, **kwargs)
    async for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        indexes = [entry.index for entry in choice.delta.tool_calls or []]
        assert len(indexes) == len(set(indexes)), "one entry per call in a chunk, as OpenAI's"
        for entry in choice.delta.tool_calls or []:
            call = calls.setdefault(entry.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += entry.id or ""
            if entry.function is not None:
                call["name"] += entry.function.name or ""
                call["arguments"] += entry.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


async def test_auto_reads_the_parsers_format(start_gateway: StartGateway) -> None:
    gw = await start_gateway(tool_call_parser="hermes")
    r = await client(gw).chat.completions.create(
        model=MODEL, messages=user("weather?"), tools=[WEATHER]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    call: Any
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    content, calls, finish = await streamed(gw, messages=user("weather?"), tools=[WEATHER])
    assert content == "Let me check. " and finish == "tool_calls"
    assert calls[0]["name"] == "weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    # no call in the answer: all content, finish_reason as the model stopped
    plain = await client(gw).chat.completions.create(
        model=MODEL, messages=user("hello"), tools=[WEATHER]
    )
    assert plain.choices[0].message.content == "Hello world!"
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


async def test_auto_needs_a_parser(gw: Running) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client(gw).chat.completions.create(model=MODEL, messages=user("x"), tools=[WEATHER])
    assert "tool-call-parser" in str(refused.value) and "tool_choice" in str(refused.value)


async def test_a_named_function_constrains_its_arguments(gw: Running, backend: FakeBackend) -> None:
    named: Any = {"type": "function", "function": {"name": "weather"}}
    r = await client(gw).chat.completions.create(
        model=MODEL, messages=user("args"), tools=[WEATHER, TIME], tool_choice=named
    )
    req = await backend.wait_for_request("args")
    assert isinstance(req.constraint, JsonSchemaConstraint)
    assert json.loads(req.constraint.schema) == WEATHER["function"]["parameters"]
    call: Any
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert r.choices[0].message.content is None
    content, calls, finish = await streamed(
        gw, messages=user("args"), tools=[WEATHER, TIME], tool_choice=named
    )
    assert content == "" and finish == "tool_calls"
    assert calls[0]["name"] == "weather" and json.loads(calls[0]["arguments"]) == {"city": "Rome"}


async def test_required_constrains_to_an_array_of_calls(gw: Running, backend: FakeBackend) -> None:
    r = await client(gw).chat.completions.create(
        model=MODEL, messages=user("calls"), tools=[WEATHER, TIME], tool_choice="required"
    )
    req = await backend.wait_for_request("calls")
    assert isinstance(req.constraint, JsonSchemaConstraint)
    schema = json.loads(req.constraint.schema)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["weather", "time"]
    got = [
        (c.function.name, json.loads(c.function.arguments))
        for c in list[Any](r.choices[0].message.tool_calls or [])
    ]
    assert got == [("weather", {"city": "Oslo"}), ("time", {})]
    assert r.choices[0].finish_reason == "tool_calls"
    _, calls, _ = await streamed(
        gw, messages=user("calls"), tools=[WEATHER, TIME], tool_choice="required"
    )
    assert [calls[i]["name"] for i in sorted(calls)] == ["weather", "time"]
    one = await client(gw).chat.completions.create(
        model=MODEL,
        messages=user("calls"),
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert one.choices
    last = backend.requests[-1]
    assert isinstance(last.constraint, JsonSchemaConstraint)
    assert json.loads(last.constraint.schema)["maxItems"] == 1


async def test_required_cut_by_max_tokens_returns_the_calls_so_far(gw: Running) -> None:
    """As a named tool's cut arguments are returned: the whole calls, then the cut one with
    the arguments as far as they came; never the raw array as content."""
    r = await client(gw).chat.completions.create(
        model=MODEL, messages=user("cut calls"), tools=[WEATHER, TIME], tool_choice="required"
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    got = [
        (c.function.name, c.function.arguments) for c in list[Any](choice.message.tool_calls or [])
    ]
    assert got == [("weather", '{"city": "Oslo"}'), ("time", '{"tz": "Eu')]
    content, calls, finish = await streamed(
        gw, messages=user("cut calls"), tools=[WEATHER, TIME], tool_choice="required"
    )
    assert content == "" and finish == "length"
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == got


def test_a_required_array_cut_before_any_call_name_is_left_as_it_is() -> None:
    assert cut_array_calls('[{"name": "wea') == []
    assert cut_array_calls("[") == []
    assert cut_array_calls("not an array") == []
    escaped = cut_array_calls('[{"name": "a\\"b", "arguments": {"x": [1, ')
    assert [(c.name, c.arguments) for c in escaped] == [('a"b', '{"x": [1,')]


async def test_the_tool_loop_passes_calls_and_results_to_the_template(
    start_gateway: StartGateway, backend: FakeBackend
) -> None:
    gw = await start_gateway(tool_call_parser="hermes")
    messages: Any = user("weather?")
    first = await client(gw).chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER]
    )
    call: Any = (first.choices[0].message.tool_calls or [])[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = await client(gw).chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER]
    )
    assert second.choices[0].message.content == "Hello world!"
    req = await backend.wait_for_request("sunny")
    assert isinstance(req.prompt, ChatPrompt)
    assistant, tool = req.prompt.messages[1], req.prompt.messages[2]
    assert assistant.tool_calls == [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": "weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", call.id, "sunny")
    assert req.prompt.tools == [
        {"type": "function", "function": {**WEATHER["function"]}},
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
                "tool_choice": "none",
            },
            "tools[0].function.name",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
async def test_bad_tool_requests_are_a_400_naming_the_field(
    gw: Running, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client(gw).chat.completions.create(model=MODEL, messages=user("x"), **extra)
    body = refused.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
