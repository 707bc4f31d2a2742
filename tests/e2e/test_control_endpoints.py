"""Issue #7's control endpoints through every service of the session's tiny stack:
/abort_request, /tokenize, /detokenize, /health_generate, /get_model_info, /get_server_info."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.stack import Stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "tiny-llama-11"
# Far more tokens than the CPU generates before the abort lands: a finish "abort" is the abort.
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


def post(stack: Stack, path: str, body: Any) -> tuple[int, Any]:
    async def main() -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{stack.base_url}{path}", json=body) as r,
        ):
            return r.status, await r.json()

    return asyncio.run(main())


def get(stack: Stack, path: str) -> tuple[int, Any]:
    async def main() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"{stack.base_url}{path}") as r:
            return r.status, await r.json()

    return asyncio.run(main())


def test_abort_request_ends_a_stream_with_abort_and_frees_its_kv(tiny_stack: Stack) -> None:
    async def main() -> tuple[list[dict[str, Any]], Any]:
        body = {"input_ids": [9, 8, 7, 6, 5], "stream": True, "sampling_params": LONG}
        base = tiny_stack.base_url
        async with aiohttp.ClientSession() as s, s.post(f"{base}/generate", json=body) as r:
            assert r.status == 200
            rid = r.headers["X-Request-Id"]
            events: list[dict[str, Any]] = []
            async for raw in r.content:
                if raw.startswith(b"data: {"):
                    events.append(json.loads(raw.removeprefix(b"data: ")))
                    if len(events) == 2:  # it is decoding: abort it from another connection
                        async with s.post(f"{base}/abort_request", json={"rid": rid}) as a:
                            aborted = (a.status, await a.json())
        return events, aborted

    events, aborted = asyncio.run(main())
    rid = events[0]["meta_info"]["id"]
    assert aborted == (200, {"aborted": [rid]})
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "matched": None}
    assert 2 <= last["meta_info"]["completion_tokens"] < 3000
    assert len(last["output_ids"]) == last["meta_info"]["completion_tokens"]
    # Every KV slot it held is free again or cached (unlocked): free == total - cached.
    load = tiny_stack.wait_idle(timeout=10.0).executor
    assert load is not None and load.free_kv_tokens == load.total_kv_tokens - load.cached_tokens
    status, error = post(tiny_stack, "/abort_request", {"rid": rid})
    assert status == 404 and error["error"]["param"] == "rid"


def test_abort_request_of_an_openai_stream_ends_it_with_finish_reason_abort(
    tiny_stack: Stack,
) -> None:
    """OpenAI clients see finish_reason "abort" (as vLLM sends it): the openai package passes
    values it does not know through."""
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finishes = []
    for i, chunk in enumerate(stream):
        if i == 2:
            rid = chunk.id.removeprefix("chatcmpl-")
            assert post(tiny_stack, "/abort_request", {"rid": rid}) == (200, {"aborted": [rid]})
        finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert finishes == ["abort"]
    tiny_stack.wait_idle(timeout=10.0)


def test_abort_all_wherever_the_requests_are(tiny_stack: Stack) -> None:
    """Aborted at once, the requests are caught wherever they are (the tokenizer's queue, the
    scheduler's, the executor): each call still ends with finish reason "abort"."""

    async def main() -> list[Any]:
        base = tiny_stack.base_url
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> Any:
                body = {"text": f"the thin {i}", "sampling_params": LONG}
                async with s.post(f"{base}/generate", json=body) as r:
                    return await r.json()

            calls = [asyncio.create_task(one(i)) for i in range(4)]
            aborted: list[str] = []
            while len(aborted) < 4:  # until the gateway has dispatched all four
                async with s.post(f"{base}/abort_request", json={"abort_all": True}) as a:
                    aborted += (await a.json())["aborted"]
                await asyncio.sleep(0.005)
            return await asyncio.gather(*calls)

    results = asyncio.run(main())
    for body in results:
        assert body["meta_info"]["finish_reason"]["type"] == "abort", body
        assert body["meta_info"]["completion_tokens"] < 3000
    tiny_stack.wait_idle(timeout=10.0)


def test_tokenize_answers_the_models_own_ids(tiny_stack: Stack, tiny_tokenizer: Any) -> None:
    text = "héllo 世界, the thin cat"
    status, body = post(tiny_stack, "/tokenize", {"text": text, "model": MODEL})
    ids = tiny_tokenizer.encode(text)
    assert status == 200
    assert body == {"tokens": ids, "count": len(ids), "max_model_len": 4096}

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, body = post(tiny_stack, "/tokenize", {"messages": messages})
    templated = tiny_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert status == 200
    assert body["tokens"] == tiny_tokenizer.encode(templated, add_special_tokens=False)


def test_detokenize_round_trips_and_refuses_unknown_ids(
    tiny_stack: Stack, tiny_tokenizer: Any
) -> None:
    text = "emoji 🙂 and 世界"
    ids = tiny_tokenizer.encode(text)
    assert post(tiny_stack, "/detokenize", {"tokens": ids}) == (200, {"text": text})
    vocab = len(tiny_tokenizer)
    status, error = post(tiny_stack, "/detokenize", {"tokens": [*ids, vocab]})
    assert status == 400 and error["error"]["param"] == f"tokens[{len(ids)}]"
    assert f"outside the vocabulary [0, {vocab})" in error["error"]["message"]


def test_health_generate_on_the_live_stack(tiny_stack: Stack) -> None:
    status, body = get(tiny_stack, "/health_generate")
    assert status == 200, body
    assert body["status"] == "ok" and len(body["token_ids"]) == 1 and body["latency_s"] > 0
    status, body = post(tiny_stack, "/health_generate", {})
    assert status == 200 and body["status"] == "ok"


def test_model_and_server_info(
    tiny_stack: Stack, tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    status, model = get(tiny_stack, "/get_model_info")
    assert status == 200
    assert model == {
        "model_path": str(tiny_model_dir),
        "tokenizer_path": str(tiny_model_dir),
        "served_model_name": MODEL,
        "is_generation": True,
        "context_length": 4096,
        "architecture": "LlamaForCausalLM",
        "vocab_size": len(tiny_tokenizer),
        "eos_token_ids": [tiny_tokenizer.eos_token_id],
        "has_chat_template": True,
    }
    status, server = get(tiny_stack, "/get_server_info")
    assert status == 200
    instances = server["instances"]
    assert len(instances["detokenizer"]) == 2  # the stack runs two partitions
    assert all(len(instances[name]) == 1 for name in ("gateway", "tokenizer", "scheduler"))
    assert server["scheduler_leader"] == instances["scheduler"][0]["instance"]
    (executor,) = server["executors"]
    assert executor["total_kv_tokens"] == 8192 and executor["context_length"] == 4096
    assert server["gateway"]["model_name"] == MODEL
