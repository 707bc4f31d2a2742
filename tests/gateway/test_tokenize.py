"""POST /tokenize and /detokenize: validation in the gateway, the call through the bus to the
fake backend's byte tokenizer, and its errors coming back; tests/e2e checks the real one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.gateway.helpers import MODEL, Running

pytestmark = pytest.mark.redis


async def post(http: Any, gw: Running, path: str, body: Any) -> tuple[int, Any]:
    async with http.post(f"{gw.url}{path}", json=body) as r:
        return r.status, await r.json()


async def test_tokenize_text_and_its_vllm_name(gw: Running, http) -> None:
    expected = {"tokens": [104, 195, 169], "count": 3, "max_model_len": 64}
    assert await post(http, gw, "/tokenize", {"text": "hé"}) == (200, expected)
    assert await post(http, gw, "/tokenize", {"prompt": "hé", "model": MODEL}) == (200, expected)


async def test_tokenize_messages(gw: Running, http) -> None:
    body = {"messages": [{"role": "user", "content": "ok"}], "add_generation_prompt": False}
    assert await post(http, gw, "/tokenize", body) == (
        200,
        {"tokens": [111, 107], "count": 2, "max_model_len": 64},
    )


async def test_detokenize(gw: Running, http) -> None:
    assert await post(http, gw, "/detokenize", {"tokens": [104, 195, 169]}) == (200, {"text": "hé"})
    assert await post(http, gw, "/detokenize", {"tokens": []}) == (200, {"text": ""})


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/tokenize", {}, "text", "exactly one of text, prompt and messages (got none)"),
        ("/tokenize", {"text": "a", "messages": []}, "text", "got text and messages"),
        ("/tokenize", {"messages": []}, "messages", "must not be empty"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ""),
        ("/tokenize", {"text": 5}, "text", "Expected `str | null`"),
        ("/detokenize", {}, "tokens", "missing required field"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens[1]", "must be a token id"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]", "Expected `int`"),
        ("/detokenize", {"tokens": [1, 300]}, "tokens[1]", "outside the vocabulary"),  # backend
    ],
)
async def test_bad_input_is_400_naming_the_field(
    gw: Running, http, path: str, body: Any, param: str, words: str
) -> None:
    status, error = await post(http, gw, path, body)
    assert status == 400, error
    assert error["error"]["param"] == param and words in error["error"]["message"]


async def test_an_unknown_model_is_404(gw: Running, http) -> None:
    status, error = await post(http, gw, "/tokenize", {"text": "a", "model": "other"})
    assert status == 404 and error["error"]["param"] == "model"
    assert "'other' does not exist" in error["error"]["message"]


async def test_no_answer_is_a_504(start_gateway: Callable[..., Awaitable[Running]], http) -> None:
    gw = await start_gateway(timeout=0.3)
    status, error = await post(http, gw, "/tokenize", {"text": "silent"})
    assert status == 504 and "no tokenizer answered within 0.3s" in error["error"]["message"]
    assert gw.state.router.queues == {}
