"""Structured output through every service: constrained requests pass the grammar service.

Enforcement in the executor's sampler is tested in tests/executor/test_grammar.py; here the
routing: gateway -> tokenizer -> grammar -> scheduler -> executor, and refusals as 400s.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.stack import Stack, start_stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async def main() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.post(stack.base_url + path, json=body) as r:
            return r.status, dict(await r.json())

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (
            "/generate",
            {"text": "hi", "sampling_params": {"regex": "[a-"}},
            "sampling_params.regex",
            "invalid regex",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "strnig"}},
                },
            },
            "response_format.json_schema.schema",
            "strnig",
        ),
    ],
)
def test_invalid_constraint_is_a_400_from_the_grammar_service(
    tiny_stack: Stack, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    status, data = post(tiny_stack, path, body)
    assert status == 400, data
    assert data["error"]["param"] == param and words in data["error"]["message"], data


def test_constrained_request_reaches_the_executor(tiny_stack: Stack) -> None:
    body = {"text": "hi", "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 4}}
    status, data = post(tiny_stack, "/generate", body)
    assert status == 200, data
    # A random model writes "yes" or "no" only when the grammar reached the sampler.
    assert data["text"] in ("yes", "no"), data
    assert data["meta_info"]["finish_reason"]["type"] == "stop", data
    tiny_stack.wait_idle()


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 99},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "maxItems": 2,
        },
    },
    "required": ["color", "size", "tags"],
}


async def _stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    text = ""
    async with s.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                text += event["choices"][0]["delta"].get("content") or ""
    return text


def test_constraints_are_enforced_through_the_stack(tiny_stack: Stack) -> None:
    import jsonschema

    chat = {
        "model": "tiny-llama-11",
        "messages": [{"role": "user", "content": "a json please"}],
        "max_tokens": 120,
        "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    }

    async def main() -> tuple[list[Any], str]:
        async with aiohttp.ClientSession() as s:
            base = tiny_stack.base_url

            async def post_json(path: str, body: dict[str, Any]) -> Any:
                async with s.post(base + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            jobs = [post_json("/v1/chat/completions", {**chat, "seed": i}) for i in range(3)] + [
                post_json(
                    "/generate",
                    {
                        "text": "pick",
                        "sampling_params": {
                            "choices": ["alpha", "beta gamma"],
                            "temperature": 1.0,
                            "seed": 1,
                        },
                    },
                ),
                post_json(
                    "/generate",
                    {
                        "text": "mail",
                        "sampling_params": {
                            "regex": r"[a-z]{1,6}@[a-z]{1,4}\.com",
                            "temperature": 1.0,
                            "max_new_tokens": 40,
                        },
                    },
                ),
                post_json(  # sampled text may end at EOS: ignore_eos runs it to its length
                    "/v1/completions",
                    {
                        "model": "tiny-llama-11",
                        "prompt": "free text",
                        "max_tokens": 8,
                        "ignore_eos": True,
                    },
                ),
            ]
            results = await asyncio.gather(*jobs)
            streamed = await _stream(
                s, base + "/v1/chat/completions", {**chat, "stream": True, "seed": 7}
            )
            return list(results), streamed

    results, streamed = asyncio.run(main())
    for data in results[:3]:
        choice = data["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    jsonschema.validate(json.loads(streamed), SCHEMA)
    assert results[3]["text"] in ("alpha", "beta gamma")
    assert results[4]["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(r"[a-z]{1,6}@[a-z]{1,4}\.com", results[4]["text"])
    # unconstrained, in the same batch: no grammar's mask or stop reached it
    assert results[5]["usage"]["completion_tokens"] == 8
    assert results[5]["choices"][0]["finish_reason"] == "length"
    tiny_stack.wait_idle()


def _forced_keys(stack: Stack) -> tuple[int, Any]:
    """Jump-forward tokens the executor reports before and after one request whose schema
    forces text (its keys), and the request's JSON output."""
    before = stack.wait_idle().executor
    assert before is not None
    # SCHEMA bounds the output (compact JSON, at most ~60 bytes): it always completes.
    body = {"text": "hi", "sampling_params": {"json_schema": SCHEMA, "max_new_tokens": 200}}
    status, data = post(stack, "/generate", body)
    assert status == 200, data
    done, deadline = time.time(), time.monotonic() + 20
    beat = stack.wait_idle()
    while beat.ts <= done:  # a heartbeat sent after the request, not a stale one
        assert time.monotonic() < deadline, f"no heartbeat since the request\n{stack.log_tail()}"
        time.sleep(0.1)
        beat = stack.wait_idle()
    assert beat.executor is not None
    return beat.executor.jump_forward_tokens - before.jump_forward_tokens, data


def test_jump_forward_is_on_by_default_and_off_with_its_flag(
    tiny_stack: Stack, tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    import jsonschema

    forced, data = _forced_keys(tiny_stack)
    assert forced > 0
    assert data["meta_info"]["finish_reason"]["type"] == "stop", data
    jsonschema.validate(json.loads(data["text"]), SCHEMA)
    # The environment twin, as compose.yaml would set it: forced text is decoded instead.
    stack = start_stack(
        ["--model", str(tiny_model_dir), "--max-total-tokens", "4096"],
        tmp_path / "no-jump.log",
        redis_url.rsplit("/", 1)[0] + "/3",
        env={"RADIXSERVE_DISABLE_JUMP_FORWARD": "1"},
    )
    try:
        forced, data = _forced_keys(stack)
        assert forced == 0
        assert data["meta_info"]["finish_reason"]["type"] == "stop", data
        jsonschema.validate(json.loads(data["text"]), SCHEMA)
    finally:
        assert stack.stop() == 0, stack.log_tail()
