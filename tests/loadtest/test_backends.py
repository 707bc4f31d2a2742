"""Request bodies and stream parsers of each backend, structured output included."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import pytest

from loadtest.backends import (
    OpenAIChat,
    OpenAICompletions,
    Options,
    RadixServe,
    Usage,
    flatten,
    sse_data,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "Q2"},
]
OPTS = Options(model="m", temperature=0.5, extra_body={"top_k": 3})


def test_flatten_keeps_earlier_messages_as_a_prefix() -> None:
    assert flatten(MESSAGES) == "S\n\nQ1\n\nA1\n\nQ2"
    assert flatten(MESSAGES).startswith(flatten(MESSAGES[:2]))


def test_openai_bodies_stream_with_usage_and_ignore_eos() -> None:
    chat = OpenAIChat().body(MESSAGES, 64, None, OPTS)
    assert chat == {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "top_k": 3,
    }
    comp = OpenAICompletions().body(MESSAGES, 64, None, Options(model="m", ignore_eos=False))
    assert comp["prompt"] == flatten(MESSAGES) and "ignore_eos" not in comp


def test_native_body() -> None:
    body = RadixServe().body(MESSAGES, 64, None, OPTS)
    assert body == {
        "text": flatten(MESSAGES),
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.5, "ignore_eos": True},
        "stream": True,
        "top_k": 3,
    }


@pytest.mark.parametrize("backend", [OpenAIChat(), OpenAICompletions()])
def test_openai_structured_output_uses_response_format(backend: Any) -> None:
    body = backend.body(MESSAGES, 64, SCHEMA, OPTS)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    assert "ignore_eos" not in body  # the grammar ends the output


def test_native_structured_output_sends_the_schema_as_a_string() -> None:
    params = RadixServe().body(MESSAGES, 64, SCHEMA, OPTS)["sampling_params"]
    assert json.loads(params["json_schema"]) == SCHEMA
    assert "ignore_eos" not in params


def test_parsers() -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    chat = OpenAIChat()
    assert chat.parse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, "") == (
        "",
        None,
    )
    assert chat.parse({"choices": [{"delta": {"content": "hi"}}]}, "") == ("hi", None)
    assert chat.parse({"choices": [], "usage": usage}, "hi") == ("", Usage(7, 2, None))
    comp = OpenAICompletions()
    detailed = {**usage, "prompt_tokens_details": {"cached_tokens": 4}}
    assert comp.parse({"choices": [{"text": " x"}], "usage": None}, "") == (" x", None)
    assert comp.parse({"choices": [], "usage": detailed}, " x") == ("", Usage(7, 2, 4))
    native = RadixServe()
    meta = {"prompt_tokens": 7, "completion_tokens": 2, "cached_tokens": 3, "finish_reason": None}
    assert native.parse({"text": "Hello wor", "meta_info": meta}, "Hello") == (
        " wor",
        Usage(7, 2, 3),
    )


class _Content:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self) -> AsyncIterator[bytes]:
        for p in self.pieces:
            yield p


class _Response:
    def __init__(self, pieces: list[bytes]) -> None:
        self.content = _Content(pieces)


async def test_sse_lines_split_across_reads_and_longer_than_aiohttp_lines() -> None:
    big = json.dumps({"text": "x" * 300_000}).encode()
    pieces = [b'data: {"a"', b": 1}\n\n: comment\n\ndata: ", big[:1000], big[1000:] + b"\n\n"]
    pieces.append(b"data: [DONE]\n\n")
    resp = cast(aiohttp.ClientResponse, _Response(pieces))
    got = [data async for _, data in sse_data(resp)]
    assert got == [b'{"a": 1}', big, b"[DONE]"]


def test_native_hop_latency_is_asked_for_and_read_from_the_last_object() -> None:
    opts = Options(model="m", hop_latency=True)
    assert RadixServe().body(MESSAGES, 8, None, opts)["return_hop_latency"] is True
    assert "return_hop_latency" not in RadixServe().body(MESSAGES, 8, None, Options(model="m"))
    last = {"text": "x", "meta_info": {"hop_latency_ms": {"queue": 1.5, "total": 9.0}}}
    assert RadixServe().hops(last) == {"queue": 1.5, "total": 9.0}
    assert RadixServe().hops({"text": "x", "meta_info": {}}) is None
    assert OpenAICompletions().hops(last) is None
