"""POST /v1/responses through the gateway (with the fake backend), driven by the openai
client's own `responses.create` and `responses.stream`; function tools: how a request's
tools and tool-loop items become the chat job, and how its calls are rendered, whole and as
the function-call events."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import openai
import pytest

from services.gateway.openai_responses.convert import responses_job
from services.gateway.openai_responses.protocol import ResponsesBody
from services.gateway.reasoning import PARSERS
from shared.messages.common import JsonSchemaConstraint
from shared.messages.tokenize import ChatPrompt
from tests.gateway.fake_backend import PROMPT_TOKENS, FakeBackend
from tests.gateway.helpers import MODEL, Running

StartGateway = Callable[..., Awaitable[Running]]


def client(gw: Running) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)


async def test_create_answers_a_response(gw: Running, backend: FakeBackend) -> None:
    r = await client(gw).responses.create(model=MODEL, input="hello", instructions="Be brief.")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Hello world!"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (PROMPT_TOKENS, 3)
    assert r.usage.input_tokens_details.cached_tokens == 2
    assert r.instructions == "Be brief."
    assert (r.model_extra or {}).get("store") is False  # nothing is kept
    req = await backend.wait_for_request("hello")
    assert isinstance(req.prompt, ChatPrompt)
    assert [(m.role, m.content) for m in req.prompt.messages] == [
        ("system", "Be brief."),
        ("user", "hello"),
    ]


async def test_input_items_become_the_conversation(gw: Running, backend: FakeBackend) -> None:
    items: Any = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "yo"}],
        },
        {"role": "user", "content": "hello"},
    ]
    r = await client(gw).responses.create(model=MODEL, input=items)
    assert r.output_text == "Hello world!"
    req = await backend.wait_for_request("hello")
    assert isinstance(req.prompt, ChatPrompt)
    assert [(m.role, m.content) for m in req.prompt.messages] == [
        ("system", "Rules."),
        ("user", "hi"),
        ("assistant", "yo"),
        ("user", "hello"),
    ]


async def test_stream_sends_the_events_the_client_assembles(gw: Running) -> None:
    kinds: list[str] = []
    deltas: list[str] = []
    async with client(gw).responses.stream(model=MODEL, input="hello") as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(deltas) == final.output_text == "Hello world!"
    assert final.status == "completed"


async def test_max_output_tokens_makes_it_incomplete(gw: Running) -> None:
    r = await client(gw).responses.create(model=MODEL, input="length", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "abc"


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_its_own_output_item(start_gateway: StartGateway, stream: bool) -> None:
    gw = await start_gateway(reasoning_parser="qwen3")
    r: Any
    if stream:
        reasoning: list[str] = []
        async with client(gw).responses.stream(model=MODEL, input="think") as s:
            async for event in s:
                if event.type == "response.reasoning_text.delta":
                    reasoning.append(event.delta)
            r = await s.get_final_response()
        assert "".join(reasoning) == "Two and two make four."
    else:
        r = await client(gw).responses.create(model=MODEL, input="think")
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    thought = r.output[0]
    assert thought.type == "reasoning" and thought.content is not None
    assert thought.content[0].text == "Two and two make four."
    assert r.output_text == "Four."
    assert PARSERS  # (the parsers the gateway may be given)


async def test_a_refusal_before_the_stream_is_an_http_error(gw: Running) -> None:
    with pytest.raises(openai.APIStatusError) as busy:
        await client(gw).responses.create(model=MODEL, input="busy", stream=True)
    assert busy.value.status_code == 503


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"background": True}, "background"),
        ({"temperature": -1}, "temperature"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
async def test_bad_requests_are_a_400_naming_the_field(
    gw: Running, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "hello", **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        await client(gw).post("/responses", cast_to=object, body=body)
    error = refused.value.body
    assert isinstance(error, dict)
    assert param in (error.get("param") or "") + error.get("message", ""), error


async def test_an_unknown_model_is_not_found(gw: Running) -> None:
    body = {"model": "other", "input": "hello"}
    with pytest.raises(openai.NotFoundError) as refused:
        await client(gw).post("/responses", cast_to=object, body=body)
    error = refused.value.body
    assert isinstance(error, dict) and error.get("param") == "model", error


# -- function tools ---------------------------------------------------------------------------
WEATHER: Any = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}
TIME: Any = {"type": "function", "name": "time", "parameters": None, "strict": None}
NAMED: Any = {"type": "function", "name": "weather"}


def job_of(**body: Any) -> Any:
    return responses_job(msgspec.convert({"input": "hi", **body}, ResponsesBody), MODEL)


def test_the_services_refusals_name_responses_fields() -> None:
    """The tokenizer's refusals (a conversation past the context, max_output_tokens past
    what is left) name `input` and `max_output_tokens`, not chat's `messages`."""
    assert job_of().api == "responses"


def test_function_tools_become_the_chat_jobs_tools() -> None:
    job = job_of(tools=[WEATHER, TIME], tool_choice=NAMED, parallel_tool_calls=True)
    # flat Responses tools -> the template's nested ones ("strict" is the request's alone)
    assert job.prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": WEATHER["parameters"],
                "description": "The weather in a city",
            },
        },
        {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}},
    ]
    assert (job.tools.mode, job.tools.name, job.tools.parallel) == ("named", "weather", False)
    assert isinstance(job.constraint, JsonSchemaConstraint)
    assert json.loads(job.constraint.schema) == WEATHER["parameters"]
    required = job_of(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert required.tools.mode == "required"
    schema = json.loads(required.constraint.schema)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    none = job_of(tools=[WEATHER], tool_choice="none")
    assert none.tools.mode == "none" and none.constraint is None and len(none.prompt.tools) == 1
    assert job_of(tool_choice="auto").tools is None  # no tools: nothing to choose from


def test_tool_loop_items_become_assistant_calls_and_tool_messages() -> None:
    call = {"type": "function_call", "name": "weather", "arguments": '{"city": "Oslo"}'}
    items: Any = [
        {"role": "user", "content": "weather in Oslo and Rome?"},
        # an earlier answer given back whole: its text, two calls (ids and status as output
        # lists them), and a reasoning item, which is left out as templates leave it out
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {"type": "message", "role": "assistant", "content": "Checking.", "id": "msg_1"},
        {**call, "call_id": "call_a", "id": "fc_1", "status": "completed"},
        {**call, "call_id": "call_b", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "rain"}],
        },
        {"type": "function_call", "call_id": "call_c", "name": "time", "arguments": ""},
        {"type": "function_call_output", "call_id": "call_c", "output": "noon"},
    ]
    job = job_of(input=items, tools=[WEATHER, TIME], tool_choice="none", instructions="Rules.")
    messages = job.prompt.messages
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Rules."),
        ("user", "weather in Oslo and Rome?"),
        ("assistant", "Checking."),
        ("tool", "sunny"),
        ("tool", "rain"),
        ("assistant", ""),
        ("tool", "noon"),
    ]
    assert messages[2].tool_calls == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "weather", "arguments": {"city": "Oslo"}},
        },
        {
            "id": "call_b",
            "type": "function",
            "function": {"name": "weather", "arguments": {"city": "Rome"}},
        },
    ]
    assert messages[5].tool_calls[0]["function"] == {"name": "time", "arguments": {}}
    tools = [(m.tool_call_id, m.name) for m in messages if m.role == "tool"]
    assert tools == [("call_a", "weather"), ("call_b", "weather"), ("call_c", "time")]


async def test_auto_reads_the_parsers_format_into_items(
    start_gateway: StartGateway, backend: FakeBackend
) -> None:
    gw = await start_gateway(tool_call_parser="hermes")
    r = await client(gw).responses.create(model=MODEL, input="weather?", tools=[WEATHER])
    assert r.status == "completed"
    message, call = r.output
    assert message.type == "message" and message.id == r.id.replace("resp_", "msg_", 1)
    assert r.output_text == "Let me check. "
    assert call.type == "function_call" and call.id == r.id.replace("resp_", "fc_", 1)
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("weather", {"city": "Paris"})
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True
    (tool,) = r.tools
    assert tool.type == "function" and tool.name == "weather" and tool.strict is True
    assert tool.parameters == WEATHER["parameters"]
    req = await backend.wait_for_request("weather?")
    assert (
        isinstance(req.prompt, ChatPrompt) and req.prompt.tools[0]["function"]["name"] == "weather"
    )
    assert req.constraint is None  # auto: free text, read by the parser
    # no call in the answer: one message item, as without tools
    plain = await client(gw).responses.create(model=MODEL, input="hello", tools=[WEATHER])
    assert [item.type for item in plain.output] == ["message"]
    assert plain.output_text == "Hello world!"


async def test_a_named_function_is_one_call_item(gw: Running, backend: FakeBackend) -> None:
    r = await client(gw).responses.create(
        model=MODEL, input="args", tools=[WEATHER, TIME], tool_choice=NAMED
    )
    (call,) = r.output
    assert call.type == "function_call" and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("weather", {"city": "Rome"})
    choice: Any = r.tool_choice  # echoed as given
    assert r.output_text == "" and (choice.type, choice.name) == ("function", "weather")
    req = await backend.wait_for_request("args")
    assert isinstance(req.constraint, JsonSchemaConstraint)
    assert json.loads(req.constraint.schema) == WEATHER["parameters"]


async def test_required_gives_an_item_per_call(gw: Running, backend: FakeBackend) -> None:
    r = await client(gw).responses.create(
        model=MODEL, input="calls", tools=[WEATHER, TIME], tool_choice="required"
    )
    calls: list[Any] = list(r.output)
    got = [(c.type, c.id, c.name, json.loads(c.arguments)) for c in calls]
    fc = r.id.replace("resp_", "fc_", 1)
    assert got == [
        ("function_call", fc, "weather", {"city": "Oslo"}),
        ("function_call", f"{fc}_1", "time", {}),
    ]
    call_ids = [c.call_id for c in calls]
    assert len(set(call_ids)) == 2 and all(c.startswith("call_") for c in call_ids)
    req = await backend.wait_for_request("calls")
    assert isinstance(req.constraint, JsonSchemaConstraint)
    assert json.loads(req.constraint.schema)["type"] == "array"


async def events_of(gw: Running, **kwargs: Any) -> tuple[list[Any], Any]:
    """Every event of a streamed response, and the response the client assembled."""
    events = []
    async with client(gw).responses.stream(model=MODEL, **kwargs) as stream:
        async for event in stream:
            events.append(event)
        final = await stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, final


def call_events(events: list[Any]) -> list[tuple[str, int, str]]:
    """(type, output_index, what it carries) of the events after response.in_progress."""
    out = []
    for e in events[2:-1]:
        kind = e.type.removeprefix("response.")
        if kind.startswith("output_item."):
            what = f"{e.item.type}:{getattr(e.item, 'arguments', '')}"
        else:
            what = getattr(e, "delta", None) or getattr(e, "arguments", None) or ""
        out.append((kind, e.output_index, what))
    return out


async def test_auto_streams_the_text_then_the_call(start_gateway: StartGateway) -> None:
    gw = await start_gateway(tool_call_parser="hermes")
    events, final = await events_of(gw, input="weather?", tools=[WEATHER])
    args = '{"city": "Paris"}'
    assert call_events(events) == [
        ("output_item.added", 0, "message:"),
        ("content_part.added", 0, ""),
        ("output_text.delta", 0, "Let me check. "),
        ("output_text.done", 0, ""),
        ("content_part.done", 0, ""),
        ("output_item.done", 0, "message:"),
        ("output_item.added", 1, "function_call:"),  # its arguments come in the deltas
        ("function_call_arguments.delta", 1, args),
        ("function_call_arguments.done", 1, args),
        ("output_item.done", 1, f"function_call:{args}"),
    ]
    added, done = events[8].item, events[11].item
    assert added.status == "in_progress" and done.status == "completed"
    assert added.id == done.id == events[9].item_id == events[10].item_id
    assert added.id.startswith("fc_") and added.call_id == done.call_id
    assert events[-1].type == "response.completed"
    message, call = events[-1].response.output
    assert (message.type, call.type, call.call_id) == ("message", "function_call", done.call_id)
    assert final.output_text == "Let me check. "
    assert (final.output[1].name, final.output[1].arguments) == ("weather", args)


async def test_a_named_call_streams_its_arguments_as_generated(gw: Running) -> None:
    events, final = await events_of(gw, input="args", tools=[WEATHER], tool_choice=NAMED)
    assert call_events(events) == [
        ("output_item.added", 0, "function_call:"),
        ("function_call_arguments.delta", 0, '{"city": '),
        ("function_call_arguments.delta", 0, '"Rome"}'),
        ("function_call_arguments.done", 0, '{"city": "Rome"}'),
        ("output_item.done", 0, 'function_call:{"city": "Rome"}'),
    ]
    assert events[2].item.name == "weather" and events[2].item.call_id.startswith("call_")
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Rome"}
    assert final.status == "completed" and call.status == "completed"


async def test_required_streams_each_call_as_an_item(gw: Running) -> None:
    events, final = await events_of(
        gw, input="calls", tools=[WEATHER, TIME], tool_choice="required"
    )
    kinds = [(kind, index) for kind, index, _ in call_events(events)]
    assert kinds == [
        ("output_item.added", 0),
        ("function_call_arguments.delta", 0),
        ("function_call_arguments.done", 0),
        ("output_item.done", 0),
        ("output_item.added", 1),
        ("function_call_arguments.delta", 1),
        ("function_call_arguments.done", 1),
        ("output_item.done", 1),
    ]
    assert [(c.name, json.loads(c.arguments)) for c in final.output] == [
        ("weather", {"city": "Oslo"}),
        ("time", {}),
    ]
    ids = [c.id for c in final.output]
    assert ids[1] == f"{ids[0]}_1"


async def test_the_tool_loop_sends_the_call_and_its_output_back(
    gw: Running, backend: FakeBackend
) -> None:
    items: Any = [{"role": "user", "content": "args"}]
    first = await client(gw).responses.create(
        model=MODEL, input=items, tools=[WEATHER], tool_choice=NAMED
    )
    (call,) = first.output
    assert call.type == "function_call"
    items += [
        call.model_dump(exclude_none=True),  # the item as it came, given back whole
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = await client(gw).responses.create(
        model=MODEL, input=items, tools=[WEATHER], tool_choice="none"
    )
    assert second.output_text == "Hello world!"
    req = await backend.wait_for_request("sunny")
    assert isinstance(req.prompt, ChatPrompt)
    user, assistant, tool = req.prompt.messages
    assert (user.role, assistant.role, assistant.content) == ("user", "assistant", "")
    assert assistant.tool_calls == [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": "weather", "arguments": {"city": "Rome"}},
        }
    ]
    assert (tool.role, tool.tool_call_id, tool.name, tool.content) == (
        "tool",
        call.call_id,
        "weather",
        "sunny",
    )


CALL: Any = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"}


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        (
            {"tools": [WEATHER, {"type": "mcp", "server_label": "x"}]},
            "tools[1].type",
            "only function tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools[0].function",
            "flat",
        ),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading", "function"),
        ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict", "boolean"),
        (
            {"tools": [{**WEATHER, "name": "bad name!"}], "tool_choice": "none"},
            "tools[0].name",
            "tools[0].name must be",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].name", "repeats"),
        (
            {"tools": [{**WEATHER, "parameters": "x"}], "tool_choice": "none"},
            "tools[0].parameters",
            "JSON schema",
        ),
        ({"tools": [WEATHER]}, "tool_choice", "--tool-call-parser"),  # auto needs a parser
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "got 'any'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "file_search"}},
            "tool_choice.type",
            "only function tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function"}},
            "tool_choice.name",
            "required",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "not in tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "text.format",
            "text.format cannot be combined",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
            "input[0].call_id",
            "no function_call",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message"),
        ({"input": [{**CALL, "name": None}]}, "input[0].name", "string"),
        ({"input": [{**CALL, "call_id": 7}]}, "input[0].call_id", "string"),
        (
            {"input": [{"role": "user", "content": "x"}, {**CALL, "arguments": "[1"}]},
            "input[1].arguments",
            "input[1].arguments must be JSON",
        ),
        (
            {
                "input": [
                    CALL,
                    {
                        "type": "function_call_output",
                        "call_id": "c1",
                        "output": [{"type": "input_image", "image_url": "x"}],
                    },
                ]
            },
            "input[1].output[0]",
            "only text",
        ),
        (
            {"input": [CALL, {"type": "function_call_output", "call_id": "c1"}]},
            "input[1].output",
            "string",
        ),
    ],
)
async def test_bad_tool_requests_are_a_400_naming_the_field(
    gw: Running, extra: dict[str, Any], param: str, says: str
) -> None:
    body = {"model": MODEL, "input": "hello", **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        await client(gw).post("/responses", cast_to=object, body=body)
    error = refused.value.body
    assert isinstance(error, dict) and error.get("param") == param, error
    assert says in error["message"], error
