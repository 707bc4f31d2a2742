"""Input limits: body size (from Content-Length and while reading a chunked body), bodies that
are not UTF-8 or nest too deeply, and prompts too long for any context, refused before the
tokenizer sees them. Unit checks first, then through the real app against the fake backend."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from services.gateway import input_limits, validation
from services.gateway.errors import ApiError
from services.gateway.protocol import CompletionBody
from shared.messages.tokenize import ChatMessage, ChatPrompt, TextPrompt, TokenPrompt
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import MODEL, Running

# Deep nesting where any JSON is accepted (a JSON schema), so only the depth can refuse it.
DEEP = (
    b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
    b'{"name": "x", "schema": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"}}}"
)
BAD_UTF8 = b'{"prompt": "caf\xc3\x28", "max_tokens": 3}'
JSON = {"Content-Type": "application/json"}


def test_a_declared_length_over_the_limit_is_a_413() -> None:
    input_limits.check_content_length(None, 10)  # chunked: checked while read
    input_limits.check_content_length(10, 10)
    with pytest.raises(ApiError) as e:
        input_limits.check_content_length(11, 10)
    assert e.value.status == 413 and "10 bytes" in e.value.message


def test_prompt_chars_count_text_and_chat_not_ids() -> None:
    chat = ChatPrompt(
        messages=[ChatMessage(role="user", content="abc"), ChatMessage(role="a", content="de")]
    )
    assert input_limits.prompt_chars(chat) == 5
    assert input_limits.prompt_chars(TextPrompt(text="x" * 7)) == 7
    assert input_limits.prompt_chars(TokenPrompt(input_ids=[1] * 50)) == 0
    input_limits.check_prompts([TextPrompt(text="x" * 9)], 0, "prompt")  # 0: no limit
    input_limits.check_prompts([TextPrompt(text="x" * 9)], 9, "prompt")
    with pytest.raises(ApiError) as e:
        input_limits.check_prompts([TextPrompt(text="x"), chat], 4, "messages")
    assert e.value.status == 400 and e.value.param == "messages"
    assert "5 characters" in e.value.message


def test_bad_utf8_and_deep_nesting_decode_to_400s() -> None:
    with pytest.raises(ApiError) as e:
        validation.decode(BAD_UTF8, CompletionBody)
    assert e.value.status == 400 and "UTF-8" in e.value.message
    with pytest.raises(ApiError) as e:
        validation.decode(DEEP, CompletionBody)
    assert e.value.status == 400 and "nests too deeply" in e.value.message


@pytest.fixture
async def small(start_gateway: Callable[..., Awaitable[Running]]) -> Running:
    return await start_gateway(max_body_bytes=4096, max_prompt_chars=100)


async def error_of(resp: Any) -> dict[str, Any]:
    body = await resp.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


@pytest.mark.redis
async def test_a_body_over_the_limit_is_413_by_length_and_chunked(
    small: Running, backend: FakeBackend, http
) -> None:
    big = json.dumps({"prompt": "x" * 60_000}).encode()
    for path in ("/v1/completions", "/tokenize", "/generate"):
        async with http.post(f"{small.url}{path}", data=big, headers=JSON) as r:
            assert r.status == 413
            # closed, not drained: the rest of the upload is never read
            assert r.headers["Connection"].lower() == "close"
            error = await error_of(r)
        assert error["code"] == 413 and "4096 bytes" in error["message"]
        assert "Content-Length 60" in error["message"]  # refused from the header

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: Transfer-Encoding chunked
        for i in range(0, len(big), 1024):
            yield big[i : i + 1024]

    async with http.post(f"{small.url}/v1/completions", data=chunks(), headers=JSON) as r:
        assert r.status == 413
        error = await error_of(r)
    assert "4096 bytes" in error["message"] and "Content-Length" not in error["message"]
    assert backend.requests == []
    # Under the limit the same route answers.
    async with http.post(f"{small.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
        assert r.status == 200, await r.text()


@pytest.mark.redis
async def test_bad_utf8_and_deep_nesting_are_400_through_the_app(gw: Running, http) -> None:
    for path in ("/v1/completions", "/tokenize"):
        async with http.post(f"{gw.url}{path}", data=BAD_UTF8, headers=JSON) as r:
            assert r.status == 400
            assert "not valid UTF-8" in (await error_of(r))["message"]
    async with http.post(f"{gw.url}/v1/completions", data=DEEP, headers=JSON) as r:
        assert r.status == 400
        assert "nests too deeply" in (await error_of(r))["message"]


@pytest.mark.redis
async def test_a_prompt_too_long_for_any_context_is_refused_before_tokenizing(
    small: Running, backend: FakeBackend, http
) -> None:
    long = "y" * 101
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", long]}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": long}]},
            "messages",
        ),
        ("/generate", {"text": long}, "text"),
        ("/tokenize", {"prompt": long}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": long}]}, "messages"),
    ]
    for path, body, param in cases:
        async with http.post(f"{small.url}{path}", json=body) as r:
            assert r.status == 400, (path, await r.text())
            error = await error_of(r)
        assert error["param"] == param and "101 characters" in error["message"], error
    assert backend.requests == []  # none reached the bus
