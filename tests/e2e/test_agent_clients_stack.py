"""Tool calling through every service with agent frameworks as the clients (issue #22):
LangChain's `ChatOpenAI(...).bind_tools(...)` and LiteLLM's `completion(..., tools=...)`,
plain and streamed, and one turn of each one's tool loop (the call executed, its result sent
back). The stack serves a random model: with a named `tool_choice` or "required" the grammar
makes every sampled call name a given tool with arguments valid against its schema, so the
frameworks' parsed calls must validate whatever the model.

Neither framework may reach beyond this machine (LiteLLM fetches its model cost map on import
unless told not to): the module refuses every lookup of another host and fails if one came."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.messages.ai import add_ai_message_chunks
from langchain_core.tools import BaseTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from tests.e2e.stack import Stack
from tests.e2e.test_control_endpoints import MODEL
from tests.e2e.test_tool_calls_stack import CLOCK, SCHEMAS, WEATHER

pytestmark = [
    pytest.mark.redis,
    pytest.mark.slow,
    # pydantic on LiteLLM's own types, when stream_chunk_builder first builds them
    pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning"),
]

SEEDS = range(4)
LOCAL_HOSTS = {None, "127.0.0.1", "localhost", "::1"}


class Weather(BaseModel):
    """The weather forecast for a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


@tool
def clock(zone: Literal["UTC", "CET"]) -> str:
    """The time in a time zone."""
    return f"12:00 {zone}"


LC_TOOLS: list[type[BaseModel] | BaseTool] = [Weather, clock]
# the schemas LangChain sends for them, which the calls' arguments must satisfy
LC_SCHEMAS = {
    t["function"]["name"]: t["function"]["parameters"]
    for t in (convert_to_openai_tool(lc_tool) for lc_tool in LC_TOOLS)
}


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[list[str]]:
    """Looking up any host but this machine fails at once (instead of hanging on a machine
    without internet); the module fails if a client tried. LiteLLM is told to stay local."""
    tried: list[str] = []
    lookup = socket.getaddrinfo

    def local_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in LOCAL_HOSTS:
            tried.append(str(name))
            raise socket.gaierror(socket.EAI_NONAME, f"{name}: this test stays on 127.0.0.1")
        return lookup(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket, "getaddrinfo", local_only)
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # the cost map bundled, not fetched
        mp.setenv("LITELLM_OFFLINE_MODE", "true")  # nor any other catalog or tokenizer
        yield tried
    assert not tried, f"a client tried to reach beyond this machine: {tried}"


@pytest.fixture(scope="module")
def litellm(offline: list[str]) -> Any:
    """LiteLLM, imported once the environment keeps it local (it reads it on import)."""
    import litellm

    litellm.suppress_debug_info = True
    return litellm


def chat_model(stack: Stack, max_tokens: int = 128) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=SecretStr("x"),
        model=MODEL,
        temperature=1.0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=30,
    )


def check_lc_call(call: Any, names: set[str]) -> None:
    assert call["name"] in names, call
    jsonschema.validate(call["args"], LC_SCHEMAS[call["name"]])


def test_langchain_bind_tools_named_and_required(tiny_stack: Stack) -> None:
    llm = chat_model(tiny_stack)
    for seed in SEEDS:
        for choice, names in (("Weather", {"Weather"}), ("required", set(LC_SCHEMAS))):
            bound = llm.bind_tools(LC_TOOLS, tool_choice=choice, parallel_tool_calls=False)
            out = bound.invoke([HumanMessage("Weather in Paris, or the time?")], seed=seed)
            assert isinstance(out, AIMessage)
            assert out.response_metadata["finish_reason"] == "tool_calls", (seed, choice, out)
            assert not out.invalid_tool_calls, (seed, choice, out.invalid_tool_calls)
            assert len(out.tool_calls) == 1, (seed, choice, out.tool_calls)
            check_lc_call(out.tool_calls[0], names)
            if choice == "Weather":  # and LangChain's own type takes them
                Weather.model_validate(out.tool_calls[0]["args"])
    tiny_stack.wait_idle()


def test_langchain_tool_loop(tiny_stack: Stack, tiny_tokenizer: Any) -> None:
    llm = chat_model(tiny_stack, max_tokens=32)
    question = HumanMessage("What time is it in Paris?")
    call = llm.bind_tools(LC_TOOLS, tool_choice="clock").invoke([question], seed=5)
    assert isinstance(call, AIMessage) and len(call.tool_calls) == 1, call
    check_lc_call(call.tool_calls[0], {"clock"})
    result = clock.invoke(call.tool_calls[0])  # LangChain runs the tool on the parsed call
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    assert result.content in ("12:00 UTC", "12:00 CET")

    final = llm.bind_tools(LC_TOOLS, tool_choice="none").invoke([question, call, result], seed=5)
    assert isinstance(final, AIMessage), final
    assert not final.tool_calls and not final.invalid_tool_calls, final
    assert isinstance(final.content, str) and final.response_metadata["finish_reason"] in (
        "stop",
        "length",
    )
    # The model saw the whole loop: its prompt is the chat template over the question, the
    # assistant's turn (this template shows no tool calls) and the tool's result.
    turns = [
        {"role": "user", "content": question.content},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": result.content},
    ]
    text = tiny_tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert final.usage_metadata is not None
    assert final.usage_metadata["input_tokens"] == len(
        tiny_tokenizer.encode(text, add_special_tokens=False)
    )
    tiny_stack.wait_idle()


def test_langchain_streams_a_named_call(tiny_stack: Stack) -> None:
    bound = chat_model(tiny_stack).bind_tools(LC_TOOLS, tool_choice="Weather")
    chunks: list[AIMessageChunk] = []
    for chunk in bound.stream([HumanMessage("Weather in Paris?")], seed=3):
        assert isinstance(chunk, AIMessageChunk), chunk
        chunks.append(chunk)
    pieces = [p for c in chunks for p in c.tool_call_chunks]
    assert {p["index"] for p in pieces} == {0}, pieces  # one call
    assert [p["name"] for p in pieces if p["name"]] == ["Weather"], pieces  # named once
    assert len([p for p in pieces if p["args"]]) > 2, pieces  # arguments as they were generated
    full = add_ai_message_chunks(chunks[0], *chunks[1:])  # what `+` does
    assert not full.invalid_tool_calls, full.invalid_tool_calls
    assert len(full.tool_calls) == 1 and full.tool_calls[0]["id"], full.tool_calls
    check_lc_call(full.tool_calls[0], {"Weather"})
    assert full.response_metadata["finish_reason"] == "tool_calls"
    tiny_stack.wait_idle()


def litellm_args(stack: Stack, **kwargs: Any) -> dict[str, Any]:
    return {
        "model": f"openai/{MODEL}",  # LiteLLM's OpenAI-compatible provider
        "api_base": f"{stack.base_url}/v1",
        "api_key": "x",
        "tools": [WEATHER, CLOCK],
        "temperature": 1.0,
        "max_tokens": 128,
        "timeout": 30,
        "num_retries": 0,
        **kwargs,
    }


def check_openai_call(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.id, call
    assert call.function.name in names, call
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_litellm_completion_tool_calls_and_loop(tiny_stack: Stack, litellm: Any) -> None:
    question = {"role": "user", "content": "Weather in Paris, or the time?"}
    named = {"type": "function", "function": {"name": "clock"}}
    for seed in SEEDS:
        for choice, names in ((named, {"clock"}), ("required", set(SCHEMAS))):
            r = litellm.completion(
                **litellm_args(tiny_stack, tool_choice=choice, parallel_tool_calls=False),
                messages=[question],
                seed=seed,
            )
            out = r.choices[0]
            assert out.finish_reason == "tool_calls", (seed, choice, out)
            calls = out.message.tool_calls or []
            assert len(calls) == 1, (seed, choice, out.message)
            check_openai_call(calls[0], names)

    # The loop: LiteLLM's own message object goes back, with the tool's result.
    message = r.choices[0].message
    messages: list[Any] = [
        question,
        message,
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    final = litellm.completion(**litellm_args(tiny_stack, tool_choice="none"), messages=messages)
    assert final.choices[0].finish_reason in ("stop", "length"), final
    assert not final.choices[0].message.tool_calls
    assert isinstance(final.choices[0].message.content, str)
    assert final.usage.prompt_tokens > r.usage.prompt_tokens  # the loop's turns were sent
    tiny_stack.wait_idle()


def test_litellm_streams_a_named_call(tiny_stack: Stack, litellm: Any) -> None:
    named = {"type": "function", "function": {"name": "weather"}}
    stream = litellm.completion(
        **litellm_args(tiny_stack, tool_choice=named),
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        seed=3,
        stream=True,
    )
    chunks = list(stream)
    # the call as a client rebuilds it from the deltas: id and name once, arguments appended
    calls: dict[int, dict[str, str]] = {}
    pieces = 0
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
            pieces += bool(d.function.arguments)
    assert list(calls) == [0] and calls[0]["id"] and calls[0]["name"] == "weather", calls
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["weather"])
    assert pieces > 2  # the arguments came in pieces, as they were generated
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # LiteLLM's own reassembly agrees
    built = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in built] == [
        (calls[0]["id"], "weather", calls[0]["arguments"])
    ]
    tiny_stack.wait_idle()
