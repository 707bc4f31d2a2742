"""The issue's crashing inputs through the whole stack: grammars that accept nothing or only
recurse, and sampling parameters at the edge of float32. Each grammar is a fast 400 naming
its field; top_p 1e-165 is served; a request in flight meanwhile is not disturbed, and the
same stack (no service restarted) serves an ordinary request afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.e2e.stack import Stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

# (path, body, the field the 400 must name)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "/generate",
        {"text": "hi", "sampling_params": {"regex": r"[^\s\S]"}},
        "sampling_params.regex",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"ebnf": "root ::= root"}},
        "sampling_params.ebnf",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"json_schema": json.dumps({"$ref": "#"})}},
        "sampling_params.json_schema",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"json_schema": json.dumps(MUTUAL)}},
        "sampling_params.json_schema",
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "m", "schema": MUTUAL},
            },
        },
        "response_format.json_schema.schema",
    ),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
]


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
        return r.status, await r.json()


async def scenario(base: str) -> None:
    async with aiohttp.ClientSession() as s:
        # Long enough to be generating while the hostile ones go through.
        long_body = {
            "text": "a b c",
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
        }
        in_flight = asyncio.create_task(post(s, base + "/generate", long_body))
        answers = await asyncio.gather(*(post(s, base + path, body) for path, body, _ in REFUSED))
        for (path, _, param), (status, data) in zip(REFUSED, answers, strict=True):
            assert status == 400, (path, param, data)
            assert data["error"]["param"] == param, (param, data)
        tiny_p = {
            "text": "hi",
            "sampling_params": {"top_p": 1e-165, "temperature": 1.0, "max_new_tokens": 8},
        }
        status, data = await post(s, base + "/generate", tiny_p)
        assert status == 200, data
        assert data["meta_info"]["completion_tokens"] >= 1
        status, data = await in_flight
        assert status == 200 and data["meta_info"]["completion_tokens"] == 200, data
        after = {"prompt": "hello", "max_tokens": 8, "temperature": 0.7}
        status, data = await post(s, base + "/v1/completions", after)
        assert status == 200 and data["choices"][0]["text"] is not None, data


def test_hostile_inputs_are_refused_and_the_stack_serves_on(tiny_stack: Stack) -> None:
    asyncio.run(scenario(tiny_stack.base_url))
    assert tiny_stack.proc.poll() is None, tiny_stack.log_tail()
    log = tiny_stack.log_path.read_text(errors="replace")
    assert "Traceback" not in log, tiny_stack.log_tail(200)
