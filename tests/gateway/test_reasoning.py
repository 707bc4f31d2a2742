"""--reasoning-parser: the thinking part of a reasoning model's output goes to
`reasoning_content` (and `reasoning`), the rest to `content`, whole or streamed, whatever
the delta boundaries; chat_template_kwargs and reasoning_effort reach the template."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import openai
import pytest

from services.gateway.grpc.server import GrpcServer
from services.gateway.reasoning import PARSERS
from shared.grpc_api import radixserve_pb2 as pb
from shared.grpc_api import radixserve_pb2_grpc as pb_grpc
from shared.messages.tokenize import ChatPrompt
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import MODEL, Running

OUTPUTS = [
    "<think>Two and two make four.</think>\n\nFour.",
    "<think>\nunfinished thought",
    "no thinking at all",
    "  <think>a</think>b",
    "<think></think>answer",
    "thought</think>\n\nanswer",
    "<thin",
    "a < b and </thinking> is not a tag</think>x",
    "",
]
EXPECTED = {
    "qwen3": [
        ("Two and two make four.", "Four."),
        ("\nunfinished thought", ""),
        ("", "no thinking at all"),
        ("a", "b"),
        ("", "answer"),
        ("", "thought</think>\n\nanswer"),
        ("", "<thin"),
        ("", "a < b and </thinking> is not a tag</think>x"),
        ("", ""),
    ],
    "deepseek-r1": [
        ("Two and two make four.", "Four."),
        ("\nunfinished thought", ""),
        ("no thinking at all", ""),
        ("a", "b"),
        ("", "answer"),
        ("thought", "answer"),
        ("<thin", ""),
        ("a < b and </thinking> is not a tag", "x"),
        ("", ""),
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_whole_outputs_split_as_each_format_says(name: str) -> None:
    assert [PARSERS[name]().split(text) for text in OUTPUTS] == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", OUTPUTS)
def test_streaming_splits_the_same_at_every_boundary(name: str, text: str) -> None:
    whole = PARSERS[name]().split(text)
    cuts = range(len(text) + 1)
    for a, b in itertools.combinations_with_replacement(cuts, 2):
        splitter = PARSERS[name]()
        pieces = [splitter.feed(p) for p in (text[:a], text[a:b], text[b:])]
        pieces.append(splitter.finish())
        got = ("".join(r for r, _ in pieces), "".join(c for _, c in pieces))
        assert got == whole, (text[:a], text[a:b], text[b:])


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", OUTPUTS)
def test_unstreamed_thinking_comes_whole_in_the_delta_that_ends_it(name: str, text: str) -> None:
    """SGLang's stream_reasoning false: the same split, the thinking in one piece, sent no
    earlier than the delta that closes it (or at the end)."""
    whole = PARSERS[name]().split(text)
    for a in range(len(text) + 1):
        splitter = PARSERS[name](stream_reasoning=False)
        pieces = [splitter.feed(text[:a]), splitter.feed(text[a:]), splitter.finish()]
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == whole
        assert sum(1 for r, _ in pieces if r) <= 1, pieces
        if "</think>" not in text[:a]:
            assert pieces[0][0] == "", (text[:a], pieces)


StartGateway = Callable[..., Awaitable[Running]]


async def test_chat_answers_carry_the_reasoning_apart(start_gateway: StartGateway) -> None:
    gw = await start_gateway(reasoning_parser="qwen3")
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "think"}]
    plain = await client.chat.completions.create(model=MODEL, messages=messages)
    message = plain.choices[0].message
    assert message.content == "Four."
    assert message.model_extra is not None
    assert message.model_extra["reasoning_content"] == "Two and two make four."
    assert message.model_extra["reasoning"] == "Two and two make four."
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    reasoning, content = [], []
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        reasoning.append(extra.get("reasoning_content") or "")
        content.append(delta.content or "")
        assert "<think" not in (delta.content or "") and "</th" not in (delta.content or "")
    assert "".join(reasoning) == "Two and two make four."
    assert "".join(content) == "Four."
    assert len([r for r in reasoning if r]) > 1  # streamed as it came
    # SGLang's stream_reasoning false: the thinking held back, then sent whole
    held = await client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, extra_body={"stream_reasoning": False}
    )
    pieces = [
        (chunk.choices[0].delta.model_extra or {}).get("reasoning_content")
        async for chunk in held
        if chunk.choices
    ]
    assert [p for p in pieces if p] == ["Two and two make four."]
    # SGLang's switch: the output as the model wrote it
    whole = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        extra_body={"separate_reasoning": False},
    )
    assert whole.choices[0].message.content == "<think>Two and two make four.</think>\n\nFour."


@pytest.mark.parametrize("switch", [{"enable_thinking": False}, {"thinking": False}])
async def test_thinking_turned_off_makes_the_output_all_answer(
    start_gateway: StartGateway, switch: dict[str, bool]
) -> None:
    """Under a parser whose output starts inside the thinking part (deepseek-r1), an output
    with no end tag is all thinking; a request that turned thinking off gets it as content,
    through chat completions and the Responses API alike."""
    gw = await start_gateway(reasoning_parser="deepseek-r1")
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    on = await client.chat.completions.create(model=MODEL, messages=messages)
    assert not on.choices[0].message.content
    assert (on.choices[0].message.model_extra or {})["reasoning_content"] == "Hello world!"
    off = await client.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"chat_template_kwargs": switch}
    )
    assert off.choices[0].message.content == "Hello world!"
    assert not (off.choices[0].message.model_extra or {}).get("reasoning_content")
    response = await client.responses.create(
        model=MODEL, input="hi", extra_body={"chat_template_kwargs": switch}
    )
    assert response.output_text == "Hello world!"
    assert [item.type for item in response.output] == ["message"]


async def test_without_a_parser_the_output_is_all_content(gw: Running) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "think"}],
    )
    assert reply.choices[0].message.content == "<think>Two and two make four.</think>\n\nFour."
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})


async def test_template_kwargs_and_effort_reach_the_tokenizer(
    gw: Running, backend: FakeBackend
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert reply.choices[0].message.content
    req = await backend.wait_for_request("hi")
    assert isinstance(req.prompt, ChatPrompt)
    assert req.prompt.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ],
)
async def test_bad_template_kwargs_are_a_400_naming_them(
    gw: Running, extra: dict[str, object], param: str
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body=extra,
        )
    assert param in str(refused.value.body)


# -- structured output after the thinking part -------------------------------------------------
JSON_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "s", "schema": {"type": "object"}},
}
TOOL: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """Send a request; only what reached the backend is checked (its scripted answer is no
    JSON and no tool call)."""
    async with http.post(url, json=body) as resp:
        await resp.read()


async def test_constrained_chat_requests_carry_the_parsers_end_tag(
    start_gateway: StartGateway, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    """With --reasoning-parser the tokenizer is told the end tag of every constrained chat
    request (it decides, from the rendered prompt, whether the grammar waits for it)."""
    gw = await start_gateway(reasoning_parser="deepseek-r1")
    chat = f"{gw.url}/v1/chat/completions"
    user = [{"role": "user", "content": "json please"}]
    await _post(http, chat, {"messages": user, "response_format": JSON_FORMAT})
    req = await backend.wait_for_request("json please")
    assert req.constraint is not None and req.think_end == "</think>"
    call = [{"role": "user", "content": "call f"}]
    await _post(http, chat, {"messages": call, "tools": [TOOL], "tool_choice": "required"})
    req = await backend.wait_for_request("call f")
    assert req.constraint is not None and req.think_end == "</think>"
    # Nothing to wait for: no constraint, or a prompt that is no chat.
    await _post(http, chat, {"messages": [{"role": "user", "content": "free"}]})
    assert (await backend.wait_for_request("free")).think_end == ""
    await _post(http, f"{gw.url}/generate", {"text": "raw", "sampling_params": {"regex": "a"}})
    raw = await backend.wait_for_request("raw")
    assert raw.constraint is not None and raw.think_end == ""


async def test_without_a_parser_constraints_start_at_the_first_token(
    gw: Running, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    user = [{"role": "user", "content": "json please"}]
    await _post(
        http, f"{gw.url}/v1/chat/completions", {"messages": user, "response_format": JSON_FORMAT}
    )
    req = await backend.wait_for_request("json please")
    assert req.constraint is not None and req.think_end == ""


async def test_grpc_chat_carries_the_end_tag_too(
    start_gateway: StartGateway, backend: FakeBackend
) -> None:
    gw = await start_gateway(reasoning_parser="qwen3")
    server = GrpcServer(gw.state, "127.0.0.1", 0, drain_timeout_s=1.0)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RadixServeStub(channel)
            sampling = pb.SamplingParams(json_schema='{"type": "object"}')
            messages = [pb.ChatMessage(role="user", content="grpc json")]
            await stub.Chat(pb.ChatRequest(messages=messages, sampling_params=sampling))
    finally:
        await server.stop()
    req = await backend.wait_for_request("grpc json")
    assert req.constraint is not None and req.think_end == "</think>"
