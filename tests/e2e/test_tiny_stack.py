"""Through every service: gateway -> tokenizer -> scheduler -> executor -> detokenizer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import torch

from tests.e2e.stack import Stack
from tests.executor.helpers import EOS_ID, hf_greedy

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MAX_TOKENS = 16


def expected(hf: torch.nn.Module, tok: Any, ids: list[int]) -> tuple[str, list[int], str]:
    out = hf_greedy(hf, ids, MAX_TOKENS)
    finish = "stop" if out and out[-1] == EOS_ID else "length"
    visible = out[:-1] if finish == "stop" else out
    return tok.decode(visible, skip_special_tokens=True), out, finish


async def sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    done = False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            break
        events.append(json.loads(data))
    assert done, "stream ended without data: [DONE]"
    return events


async def completion(
    s: aiohttp.ClientSession, base: str, prompt: str, stream: bool
) -> tuple[str, str, dict[str, Any] | None]:
    body = {
        "model": "tiny-llama-11",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with s.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            data = await resp.json()
            choice = data["choices"][0]
            return choice["text"], choice["finish_reason"], data["usage"]
        events = await sse(resp)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    return text, finish, events[-1]["usage"]


async def chat(
    s: aiohttp.ClientSession, base: str, content: str, stream: bool
) -> tuple[str, str, dict[str, Any] | None]:
    body = {
        "model": "tiny-llama-11",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            data = await resp.json()
            choice = data["choices"][0]
            assert choice["message"]["role"] == "assistant"
            return choice["message"]["content"], choice["finish_reason"], data["usage"]
        events = await sse(resp)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    finish = [e["choices"][0]["finish_reason"] for e in events][-1]
    return text, finish, None


async def generate(
    s: aiohttp.ClientSession, base: str, ids: list[int], stream: bool
) -> tuple[str, str, list[int]]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
        "stream": stream,
    }
    async with s.post(f"{base}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json() if not stream else (await sse(resp))[-1]
    return data["text"], data["meta_info"]["finish_reason"]["type"], data["output_ids"]


def test_sixteen_concurrent_requests_match_transformers(
    tiny_stack: Stack, tiny_hf: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    tok = tiny_tokenizer
    prompts = [
        f"the thin {w} in the {i}"
        for i, w in enumerate(["cat", "dog", "héllo", "世界", "a", "bb", "the", "in"])
    ]

    async def main() -> list[Any]:
        async with aiohttp.ClientSession() as s:
            jobs: list[Any] = []
            for i, p in enumerate(prompts[:4]):
                jobs.append(completion(s, tiny_stack.base_url, p, stream=i % 2 == 0))
            for i, p in enumerate(prompts[4:8]):
                jobs.append(chat(s, tiny_stack.base_url, p, stream=i % 2 == 0))
            for i, p in enumerate(prompts):
                ids = tok.encode(p)
                jobs.append(generate(s, tiny_stack.base_url, ids, stream=i % 2 == 0))
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert len(results) == 16
    for i, p in enumerate(prompts[:4]):
        text, finish, usage = results[i]
        ids = tok.encode(p)
        exp_text, exp_ids, exp_finish = expected(tiny_hf, tok, ids)
        assert (text, finish) == (exp_text, exp_finish), f"completion {i}"
        counts = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert counts == {
            "prompt_tokens": len(ids),
            "completion_tokens": len(exp_ids),
            "total_tokens": len(ids) + len(exp_ids),
        }
    for j, p in enumerate(prompts[4:8]):
        text, finish, _ = results[4 + j]
        templ = tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(templ, add_special_tokens=False)
        exp_text, _, exp_finish = expected(tiny_hf, tok, ids)
        assert (text, finish) == (exp_text, exp_finish), f"chat {j}"
    for k, p in enumerate(prompts):
        text, finish, out_ids = results[8 + k]
        exp_text, exp_ids, exp_finish = expected(tiny_hf, tok, tok.encode(p))
        assert (text, finish, out_ids) == (exp_text, exp_finish, exp_ids), f"generate {k}"
    tiny_stack.wait_idle()


def test_abort_mid_stream_frees_the_kv_slots(tiny_stack: Stack) -> None:
    (before,) = tiny_stack.executor_loads()
    assert before.executor is not None

    async def main() -> int:
        body = {
            "input_ids": [5, 6, 7, 8],
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        chunks = 0
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{tiny_stack.base_url}/generate", json=body) as resp,
        ):
            assert resp.status == 200
            async for raw in resp.content:
                if raw.startswith(b"data: "):
                    chunks += 1
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    assert asyncio.run(main()) == 3
    # Idle with one more request ended early: the executor aborted it (it did not run out
    # its tokens), and its KV slots are free or cached, none held.
    aborted_before = before.executor.aborted_requests
    beat = tiny_stack.wait_idle(until=lambda load: load.aborted_requests == aborted_before + 1)
    assert beat.executor is not None and beat.executor.running == 0


def test_stop_string_ends_the_output(
    tiny_stack: Stack, tiny_hf: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    prompt = "the thin cat in the 0"
    ids = tiny_tokenizer.encode(prompt)
    full, _, _ = expected(tiny_hf, tiny_tokenizer, ids)
    cut = max(1, len(full) // 2)
    stop = full[cut : cut + 2]
    want = full[: full.index(stop)]

    async def main() -> dict[str, Any]:
        body = {
            "model": "tiny-llama-11",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stop": [stop],
        }
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{tiny_stack.base_url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            return dict(await resp.json())

    data = asyncio.run(main())
    assert data["choices"][0]["text"] == want
    assert data["choices"][0]["finish_reason"] == "stop"
    tiny_stack.wait_idle()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/completions",
            {"model": "tiny-llama-11", "prompt": "x " * 5000, "max_tokens": 4},
            "prompt",
        ),
        (
            "/v1/completions",
            {"model": "tiny-llama-11", "prompt": "hi", "max_tokens": 99999},
            "max_tokens",
        ),
        ("/v1/chat/completions", {"model": "tiny-llama-11", "messages": []}, "messages"),
        (
            "/v1/completions",
            {"model": "tiny-llama-11", "prompt": "hi", "max_tokens": -3},
            "max_tokens",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    tiny_stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    async def main() -> tuple[int, dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(tiny_stack.base_url + path, json=body) as resp,
        ):
            return resp.status, dict(await resp.json())

    status, data = asyncio.run(main())
    assert status == 400, data
    assert data["error"]["param"] == param, data
    assert data["error"]["message"]


def test_an_unknown_model_is_a_404(tiny_stack: Stack) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert refused.value.status_code == 404 and refused.value.param == "model"
    assert "tiny-llama-11" in refused.value.message


def test_openai_client(tiny_stack: Stack, tiny_hf: torch.nn.Module, tiny_tokenizer: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama-11"]
    prompt = "the thin dog"
    exp_text, exp_ids, exp_finish = expected(tiny_hf, tiny_tokenizer, tiny_tokenizer.encode(prompt))
    resp = client.completions.create(
        model="tiny-llama-11", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert resp.choices[0].text == exp_text
    assert resp.choices[0].finish_reason == exp_finish
    assert resp.usage is not None and resp.usage.completion_tokens == len(exp_ids)
    stream = client.chat.completions.create(
        model="tiny-llama-11",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    templ = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    chat_text, _, _ = expected(
        tiny_hf, tiny_tokenizer, tiny_tokenizer.encode(templ, add_special_tokens=False)
    )
    assert text == chat_text
    tiny_stack.wait_idle()


def test_repeated_prompt_reports_cached_tokens_and_flush_empties_the_cache(
    tiny_stack: Stack,
) -> None:
    ids = list(range(40, 90))

    async def main() -> tuple[int, int, int, dict[str, Any]]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{tiny_stack.base_url}/generate", json=body) as resp:
                first = (await resp.json())["meta_info"]["cached_tokens"]
            async with s.post(f"{tiny_stack.base_url}/generate", json=body) as resp:
                second = (await resp.json())["meta_info"]["cached_tokens"]
            tiny_stack.wait_idle()
            async with s.post(f"{tiny_stack.base_url}/flush_cache", json={}) as resp:
                status, data = resp.status, dict(await resp.json())
        return first, second, status, data

    first, second, status, data = asyncio.run(main())
    assert second == len(ids) - 1 and first < second
    assert status == 200, data
    beat = tiny_stack.wait_idle()
    assert beat.executor is not None and beat.executor.cached_tokens == 0


def test_flush_cache_refused_while_a_request_runs(tiny_stack: Stack) -> None:
    async def main() -> tuple[int, dict[str, Any]]:
        body = {
            "input_ids": [1, 2, 3],
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{tiny_stack.base_url}/generate", json=body) as gen,
        ):
            await gen.content.readline()  # the request is running
            await asyncio.to_thread(tiny_stack.wait_running)  # and a heartbeat says so
            async with s.post(f"{tiny_stack.base_url}/flush_cache", json={}) as resp:
                return resp.status, dict(await resp.json())

    status, data = asyncio.run(main())
    assert status == 400 and "running" in data["error"]["message"]
    tiny_stack.wait_idle()


def test_n_samples_share_the_prompt(tiny_stack: Stack, tiny_tokenizer: Any) -> None:
    prompt = "the thin cat in the hat " * 6  # long enough to be shared, not recomputed
    prompt_len = len(tiny_tokenizer.encode(prompt))

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with aiohttp.ClientSession() as s:
            body = {
                "model": "tiny-llama-11",
                "prompt": prompt,
                "max_tokens": 6,
                "temperature": 1.0,
                "seed": 5,
                "n": 4,
            }
            async with s.post(f"{tiny_stack.base_url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                plain = dict(await r.json())
            chat = {
                "model": "tiny-llama-11",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "temperature": 1.0,
                "n": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with s.post(f"{tiny_stack.base_url}/v1/chat/completions", json=chat) as r:
                events = await sse(r)
        return plain, events

    plain, events = asyncio.run(main())
    choices = plain["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert len({c["text"] for c in choices}) > 1  # different seeds, different samples
    usage = plain["usage"]
    assert usage["prompt_tokens"] == prompt_len  # counted once
    assert usage["completion_tokens"] <= 4 * 6
    # The first sample computed the prompt; the others took it from the cache.
    assert usage["prompt_tokens_details"]["cached_tokens"] == prompt_len - 1
    finished = {
        e["choices"][0]["index"]
        for e in events
        if e["choices"] and e["choices"][0]["finish_reason"]
    }
    assert finished == {0, 1, 2}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    tiny_stack.wait_idle()
