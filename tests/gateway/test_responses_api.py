"""POST /v1/responses through the gateway (with the fake backend), driven by the openai
client's own `responses.create` and `responses.stream`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from services.gateway.reasoning import PARSERS
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
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].type"),
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
        ({"model": "other"}, "model"),
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
