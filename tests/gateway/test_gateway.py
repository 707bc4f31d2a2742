"""The gateway on a real port against a real Redis, with a scripted fake backend."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from services.gateway.main import Gateway, build_parser
from shared import constants
from shared.bus import publish
from shared.messages.common import ChoiceConstraint, JsonSchemaConstraint, SamplingParams
from shared.messages.reply import Delta, Usage
from shared.messages.tokenize import ChatMessage, ChatPrompt, TextPrompt, TokenPrompt
from shared.service import Service
from tests.gateway.fake_backend import FakeBackend, client_rid
from tests.gateway.helpers import MODEL, Running, read_sse, wait_until

pytestmark = pytest.mark.redis

USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 3,
    "total_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 2},
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


# --- OpenAI API ---


async def test_completion_shape(gw: Running, backend: FakeBackend, http) -> None:
    sent = time.time()
    async with http.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
        assert r.status == 200 and r.content_type == "application/json"
        body = await r.json()
        rid = r.headers["X-Request-Id"]
    answered = time.time()
    # the unix second the gateway answered in: between the call's two ends
    assert isinstance(body["created"], int) and int(sent) <= body["created"] <= answered
    assert body == {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": body["created"],
        "model": MODEL,
        "choices": [
            {"index": 0, "text": "Hello world!", "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": USAGE,
    }
    (req,) = backend.requests
    assert req.trace.rid == rid and len(rid) == 32
    assert req.prompt == TextPrompt(text="hi")
    assert req.sampling == SamplingParams(max_new_tokens=16)  # OpenAI's completions default
    assert req.stream is False


async def test_completion_stream_with_usage(gw: Running, http) -> None:
    body = {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{gw.url}/v1/completions", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        rid = r.headers["X-Request-Id"]
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    head = {"id": f"cmpl-{rid}", "object": "text_completion", "model": MODEL}
    for c in chunks:
        assert {k: c[k] for k in head} == head and isinstance(c["created"], int)
    texts = [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert texts == [("Hello", None), (" world", None), ("!", "stop")]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    gw: Running, http, path: str
) -> None:
    """vLLM's stream option: each chunk of a choice carries its usage so far (the role chunk
    of chat, sent before any token, has none), and the last chunk the whole."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    base = {"prompt": [1, 2, 3]} if path == "/v1/completions" else CHAT
    async with http.post(
        f"{gw.url}{path}", json={**base, "stream": True, "stream_options": options}
    ) as r:
        chunks = (await read_sse(r))[:-1]
    streamed = chunks[:-1]
    if path == "/v1/chat/completions":
        role, streamed = streamed[0], streamed[1:]
        assert role["usage"] is None
    tokens = [c["usage"]["completion_tokens"] for c in streamed]  # every chunk has usage
    assert tokens == sorted(tokens) and len(set(tokens)) > 1
    assert tokens[-1] == USAGE["completion_tokens"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE


async def test_chat_shape(gw: Running, backend: FakeBackend, http) -> None:
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        body = await r.json()
        rid = r.headers["X-Request-Id"]
    assert body == {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": body["created"],
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    (req,) = backend.requests
    assert req.sampling == SamplingParams()  # max_tokens None: up to the context length


async def test_chat_stream_chunks(gw: Running, http) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    choices = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert choices == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hello"}, None),
        ({"content": " world"}, None),
        ({"content": "!"}, None),
        ({}, "stop"),
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE


async def test_chat_stream_without_usage_has_no_usage_field(gw: Running, http) -> None:
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]" and len(events) == 6
    assert all("usage" not in c and len(c["choices"]) == 1 for c in events[:-1])


async def test_chat_request_reaches_tokenizer_as_sent(
    gw: Running, backend: FakeBackend, http
) -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            },
        ],
        "max_completion_tokens": 7,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.1,
        "stop": "\n",
        "stop_token_ids": [2],
        "seed": 3,
    }
    sent = time.time()
    async with http.post(
        f"{gw.url}/v1/chat/completions", json=body, headers={"traceparent": traceparent}
    ) as r:
        assert r.status == 200
    answered = time.time()
    (req,) = backend.requests
    assert req.prompt == ChatPrompt(
        messages=[
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="one\ntwo"),
        ]
    )
    assert req.sampling == SamplingParams(
        max_new_tokens=7,
        temperature=0.0,
        top_p=0.9,
        top_k=40,
        min_p=0.1,
        stop=["\n"],
        stop_token_ids=[2],
        seed=3,
    )
    assert req.trace.traceparent == traceparent
    assert req.trace.reply_to == constants.reply_stream(gw.state.settings.instance_id)
    # the gateway's request timeout (5 s here) from when it took the request
    assert sent + 5 <= req.trace.deadline <= answered + 5


async def test_structured_output_reaches_tokenizer(gw: Running, backend: FakeBackend, http) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    chat = {"model": MODEL, "messages": OK_MSG, "response_format": fmt}
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat) as r:
        assert r.status == 200
    native = {"text": "hi", "sampling_params": {"choices": ["yes", "no"]}}
    async with http.post(f"{gw.url}/generate", json=native) as r:
        assert r.status == 200
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    await client.chat.completions.create(
        model=MODEL, messages=messages, response_format=response_format
    )
    await client.close()
    first, second, third = backend.requests
    assert third.constraint == first.constraint
    assert first.constraint == JsonSchemaConstraint(
        schema='{"type":"object","properties":{"b":{"type":"integer"},"a":{}}}',
        param="response_format.json_schema.schema",
    )
    assert second.constraint == ChoiceConstraint(
        choices=["yes", "no"], param="sampling_params.choices"
    )


async def test_models(gw: Running, http) -> None:
    async with http.get(f"{gw.url}/v1/models") as r:
        body = await r.json()
    card = {"id": MODEL, "object": "model", "created": body["data"][0]["created"]}
    assert body == {"object": "list", "data": [{**card, "owned_by": "radixserve"}]}
    async with http.get(f"{gw.url}/v1/models/other") as r:
        assert r.status == 404 and (await r.json())["error"]["param"] == "model"


# --- native API ---


async def test_generate(gw: Running, backend: FakeBackend, http) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    async with http.post(f"{gw.url}/generate", json=body) as r:
        assert r.status == 200
        out = await r.json()
    rid = out["meta_info"]["id"]
    assert out == {
        "text": "Hello world!",
        "output_ids": [101, 102, 103],
        "meta_info": {
            "id": rid,
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "cached_tokens": 2,
            "finish_reason": {"type": "stop", "matched": 2},
        },
    }
    (req,) = backend.requests
    assert req.sampling == SamplingParams(max_new_tokens=4, temperature=0.0)


async def test_generate_stream_is_cumulative(gw: Running, backend: FakeBackend, http) -> None:
    body = {"input_ids": [5, 6], "stream": True, "rid": "my-rid.1"}
    async with http.post(f"{gw.url}/generate", json=body) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == "my-rid.1"
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    seen = [(e["text"], e["output_ids"], e["meta_info"]["finish_reason"]) for e in events[:-1]]
    assert seen == [
        ("Hello", [101], None),
        ("Hello world", [101, 102], None),
        ("Hello world!", [101, 102, 103], {"type": "stop", "matched": 2}),
    ]
    assert {e["meta_info"]["id"] for e in events[:-1]} == {"my-rid.1"}
    (req,) = backend.requests
    assert req.prompt == TokenPrompt(input_ids=[5, 6])
    # a rid the client chose travels under an id of its own (shared/request_ids.py)
    assert req.trace.rid != "my-rid.1" and client_rid(req.trace.rid) == "my-rid.1"
    assert req.sampling.max_new_tokens == 128 and req.stream is True


async def test_generate_rid_in_flight_is_refused(gw: Running, backend: FakeBackend, http) -> None:
    first = asyncio.create_task(http.post(f"{gw.url}/generate", json={"text": "hang", "rid": "x"}))
    await backend.wait_for_request("hang")
    async with http.post(f"{gw.url}/generate", json={"text": "hi", "rid": "x"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "rid"
    first.cancel()
    assert (await backend.wait_for_abort("x")).reason == "client disconnected"


async def test_health(gw: Running, redis_url: str, aredis: aioredis.Redis, http) -> None:
    async with http.get(f"{gw.url}/health") as r:
        assert r.status == 503
        body = await r.json()
    assert body["missing"] == ["tokenizer", "grammar", "scheduler", "executor", "detokenizer"]
    assert body["error"]["code"] == 503 and "tokenizer" in body["error"]["message"]
    services = [
        Service(name, "i1", redis_url) for name in ("tokenizer", "grammar", "scheduler", "executor")
    ]
    for s in services:
        await s.beat_once()
    async with http.get(f"{gw.url}/health") as r:
        body = await r.json()
    # A scheduler that does not lead routes nothing: it does not count.
    assert r.status == 503 and body["missing"] == ["scheduler", "detokenizer"]
    assert "leads" in body["reasons"]["scheduler"]
    await aredis.set(constants.SCHEDULER_LEADER_KEY, "i1", px=5000)
    services.append(Service("detokenizer", "i1", redis_url))
    await services[-1].beat_once()
    async with http.get(f"{gw.url}/health") as r:
        assert r.status == 200
        body = await r.json()
    assert body["status"] == "ok" and set(body["instances"].values()) == {1}
    await aredis.delete(constants.live_key("tokenizer", "i1"))  # what the supervisor does
    async with http.get(f"{gw.url}/health") as r:
        assert r.status == 503 and (await r.json())["missing"] == ["tokenizer"]
    for s in services:
        await s.r.aclose()


# --- bad input ---

OK_MSG = [{"role": "user", "content": "hi"}]
BAD_INPUT = [
    ("/v1/completions", b'{"prompt": "hi"', None, "invalid JSON"),
    ("/v1/completions", [1], None, "Expected `object`, got `array`"),
    ("/v1/completions", {"model": MODEL}, "prompt", "missing required field `prompt`"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "missing required field"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens", "got `str`"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", "between 0 and"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens", "1000000"),
    (
        "/v1/chat/completions",
        {"messages": OK_MSG, "max_completion_tokens": -1},
        "max_completion_tokens",
        "between 0",
    ),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ("/v1/chat/completions", {"messages": OK_MSG, "top_p": 1.5}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k", "-1"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, "min_p", "[0, 1]"),
    ("/v1/chat/completions", {"messages": OK_MSG, "n": 17}, "n", "between 1 and 16"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "between 1 and 16"),
    ("/v1/completions", {"prompt": "hi", "foo": 1}, "foo", "unknown field `foo`"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "x": 1}]},
        "messages[0].x",
        "unknown field",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        "only text content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
        "must be a string",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
        "must be one of",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "must not be empty"),
    ("/v1/completions", {"prompt": ""}, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": []}, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]", "must not be empty"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt[1]", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}, "stop", "at most 16"),
    (
        "/v1/completions",
        {"prompt": "hi", "presence_penalty": 2.5},
        "presence_penalty",
        "between -2 and 2",
    ),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    (
        "/v1/chat/completions",
        {"messages": OK_MSG, "top_logprobs": 3},
        "top_logprobs",
        "needs logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": OK_MSG, "response_format": {"type": "xml"}},
        "response_format.type",
        "Invalid value 'xml'",
    ),
    (
        "/v1/chat/completions",
        {"messages": OK_MSG, "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.name",
        "missing required field",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": OK_MSG,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n"}},
        },
        "response_format.json_schema.schema",
        "required",
    ),
    ("/generate", {"sampling_params": {}}, "text", "required"),
    ("/generate", {"text": "a", "input_ids": [1]}, "input_ids", "not both"),
    ("/generate", {"input_ids": [1, -1]}, "input_ids[1]", ">= 0"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"temperature": -1}},
        "sampling_params.temperature",
        ">= 0",
    ),
    (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        "sampling_params.max_new_tokens",
        "between 0",
    ),
    (
        "/generate",
        {"text": "a", "sampling_params": {"bogus": 1}},
        "sampling_params.bogus",
        "unknown field",
    ),
    (
        "/generate",
        {"text": "a", "sampling_params": {"n": 30}},
        "sampling_params.n",
        "between 1 and 16",
    ),
    (
        "/generate",
        {"text": "a", "sampling_params": {"json_schema": "{}", "regex": "a+"}},
        "sampling_params.regex",
        "at most one structured-output constraint",
    ),
    (
        "/generate",
        {"text": "a", "sampling_params": {"choices": []}},
        "sampling_params.choices",
        "1 to 1024 strings",
    ),
    ("/generate", {"text": "a", "rid": "has space"}, "rid", "rid must be"),
]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}),
        ("/v1/chat/completions", {"messages": OK_MSG, "model": "gpt-4"}),
    ],
)
async def test_an_unknown_model_is_404(gw: Running, backend: FakeBackend, http, path, body) -> None:
    """As OpenAI and vLLM answer it: the `openai` client raises NotFoundError."""
    async with http.post(f"{gw.url}{path}", json=body) as r:
        assert r.status == 404
        error = (await r.json())["error"]
    assert error["param"] == "model" and error["code"] == 404, error
    assert "'gpt-4' does not exist" in error["message"] and MODEL in error["message"]
    assert error["type"] == "not_found_error"
    assert backend.requests == []


@pytest.mark.parametrize(("path", "body", "param", "fragment"), BAD_INPUT)
async def test_bad_input_is_400_naming_the_field(
    gw: Running,
    backend: FakeBackend,
    http,
    path: str,
    body: Any,
    param: str | None,
    fragment: str,
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}  # raw bytes, declared as JSON
    async with http.post(f"{gw.url}{path}", data=data, headers=headers) as r:
        assert r.status == 400 and r.content_type == "application/json"
        error = (await r.json())["error"]
    assert error["param"] == param, error
    assert fragment in error["message"], error
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert backend.requests == []  # nothing reached the tokenizer


async def test_unknown_route_and_method_are_json(gw: Running, http) -> None:
    async with http.get(f"{gw.url}/nope") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == 404
    async with http.get(f"{gw.url}/v1/completions") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"
        assert (await r.json())["error"]["type"] == "invalid_request_error"


# --- failures, disconnects, deadlines ---


@pytest.mark.parametrize("stream", [False, True])
async def test_early_failure_is_a_plain_http_error(gw: Running, http, stream: bool) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "too long"}], "stream": stream}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as r:
        assert r.status == 400 and r.content_type == "application/json"
        assert await r.json() == {
            "error": {
                "message": "prompt is too long",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": 400,
            }
        }
    async with http.post(f"{gw.url}/generate", json={"text": "busy", "stream": stream}) as r:
        assert r.status == 503 and (await r.json())["error"]["message"] == "queue is full"
    assert gw.state.router.queues == {}


async def test_failure_mid_stream_is_an_error_event(gw: Running, http) -> None:
    async with http.post(
        f"{gw.url}/v1/completions", json={"prompt": "fail mid", "stream": True}
    ) as r:
        assert r.status == 200
        events = await read_sse(r)
    assert [e["choices"][0]["text"] for e in events[:1]] == ["a"]
    assert events[1:] == [
        {"error": {"message": "executor lost", "type": "server_error", "param": None, "code": 503}},
        "[DONE]",
    ]


async def test_disconnect_mid_stream_aborts(gw: Running, backend: FakeBackend, http) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "hang"}], "stream": True}
    r = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    assert r.status == 200
    async for line in r.content:
        if b"partial" in line:
            break
    rid = r.headers["X-Request-Id"]
    r.close()  # drops the connection
    assert (await backend.wait_for_abort(rid)).reason == "client disconnected"
    await wait_until(lambda: gw.state.router.queues == {})


async def test_disconnect_before_the_answer_aborts(gw: Running, backend: FakeBackend, http) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(http.post(f"{gw.url}/v1/completions", json={"prompt": "hang"}), 0.3)
    rid = (await backend.wait_for_request("hang")).trace.rid
    assert (await backend.wait_for_abort(rid)).reason == "client disconnected"
    await wait_until(lambda: gw.state.router.queues == {})


async def test_deadline(start_gateway, backend: FakeBackend, http) -> None:
    gw = await start_gateway(timeout=0.4)
    async with http.post(f"{gw.url}/v1/completions", json={"prompt": "silent"}) as r:
        assert r.status == 504
        error = (await r.json())["error"]
        rid = r.headers["X-Request-Id"]
    assert error["code"] == 504 and "timed out" in error["message"]
    assert (await backend.wait_for_abort(rid)).reason == "deadline"
    # streaming: headers went out with the first reply, so the timeout is an error event
    async with http.post(f"{gw.url}/generate", json={"text": "hang", "stream": True}) as r:
        assert r.status == 200
        events = await read_sse(r)
        rid = r.headers["X-Request-Id"]
    assert events[0]["text"] == "partial" and events[1]["error"]["code"] == 504
    assert events[2:] == ["[DONE]"]
    assert (await backend.wait_for_abort(rid)).reason == "deadline"


async def test_replies_for_unknown_rids_are_dropped(gw: Running, aredis) -> None:
    stray = Delta(
        rid="nobody", text="x", token_ids=[1], usage=Usage(prompt_tokens=1, completion_tokens=1)
    )
    await publish(aredis, gw.state.router.stream, stray)
    await wait_until(lambda: gw.state.router.dropped == 1)


# --- the real openai client ---


async def test_openai_client(gw: Running) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert chat.choices[0].message.content == "Hello world!"
    assert chat.choices[0].finish_reason == "stop" and chat.usage and chat.usage.total_tokens == 8

    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world!"
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 3

    completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    assert completion.choices[0].text == "Hello world!" and completion.id.startswith("cmpl-")
    text_stream = await client.completions.create(model=MODEL, prompt="hi", stream=True)
    assert "".join([c.choices[0].text async for c in text_stream]) == "Hello world!"

    assert [m.id async for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as bad:
        await client.completions.create(model="other", prompt="hi")
    assert bad.value.status_code == 404 and bad.value.param == "model"
    await client.close()


# --- the process: liveness key and draining on SIGTERM ---


async def test_stop_drains_in_flight_requests(
    redis_url: str, backend: FakeBackend, aredis: aioredis.Redis, http
) -> None:
    args = build_parser().parse_args(
        [
            "--redis-url",
            redis_url,
            "--port",
            "0",
            "--instance-id",
            "gw-drain",
            "--drain-timeout",
            "3",
            "--served-model-name",
            MODEL,
            "--serve-before-ready",  # the fake backend sends no heartbeats
        ]
    )
    gateway = Gateway(args, MODEL)
    task = asyncio.create_task(gateway.run())
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(gateway.serving.wait(), 5)
        url = f"http://127.0.0.1:{gateway.port}"
        assert await aredis.exists(constants.live_key("gateway", "gw-drain"))
        async with http.post(f"{url}/generate", json={"text": "slow", "stream": True}) as r:
            assert r.status == 200
            first = json.loads((await r.content.readuntil(b"\n\n")).removeprefix(b"data: "))
            assert first["text"] == "t0"
            gateway.service.stop()  # what SIGTERM does
            events = await read_sse(r)
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
        await asyncio.wait_for(task, 5)
        assert not await aredis.exists(constants.live_key("gateway", "gw-drain"))
        assert not await aredis.exists(constants.reply_stream("gw-drain"))
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientConnectionError):
                await fresh.get(f"{url}/health")
    finally:
        task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
