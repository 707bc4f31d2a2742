"""The sampling parameters and API surface through every service, with the real `openai`
client where OpenAI's API has the feature: logprobs, echo, n, best_of, batches of prompts,
stop, usage, logit bias, seeds; and SGLang's /generate batches with logprobs."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import openai
import pytest
import torch

from tests.e2e.stack import Stack
from tests.e2e.test_tiny_stack import sse
from tests.executor.helpers import EOS_ID, hf_greedy

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "tiny-llama-11"


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1]: log p(ids[i] | ids[:i]) for i >= 1, from transformers."""
    with torch.no_grad():
        lps = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lps[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_completion_logprobs_and_echo_match_transformers(
    tiny_stack: Stack, tiny_hf: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    prompt = "the thin dog sat"
    prompt_ids = tiny_tokenizer.encode(prompt)
    resp = client(tiny_stack).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    assert len(lp.tokens) == len(prompt_ids) + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None
    assert "".join(lp.tokens[: len(prompt_ids)]) == prompt
    assert lp.text_offset is not None and lp.text_offset[: len(prompt_ids)] == [
        prompt.index(t, i) if t else i for i, t in enumerate(lp.tokens[: len(prompt_ids)])
    ]
    output_ids = hf_greedy(tiny_hf, prompt_ids, 8)
    ref = hf_logprobs(tiny_hf, prompt_ids + output_ids)
    got = torch.tensor([float(x) for x in lp.token_logprobs[1:]])
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
    tops_tokens = zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:], strict=True)
    for tops, token, value in tops_tokens:
        # At most 3 alternatives plus the chosen token; tokens that are parts of one UTF-8
        # character all read U+FFFD and share a key (OpenAI's dict shape cannot hold both).
        assert tops is not None and 1 <= len(tops) <= 4 and token in tops
        if "\ufffd" not in token:
            assert tops[token] == value


def test_chat_logprobs_streamed_and_not_agree(
    tiny_stack: Stack, tiny_hf: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    c = client(tiny_stack)
    messages: Any = [{"role": "user", "content": "hi there"}]
    args: dict[str, Any] = dict(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    plain = c.chat.completions.create(**args)
    content = plain.choices[0].logprobs
    assert content is not None and content.content is not None
    chunks = list(c.chat.completions.create(**args, stream=True))
    streamed = [
        t
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content or []
    ]
    # The second request finds the prompt cached: the same values up to float rounding.
    assert [t.token for t in streamed] == [t.token for t in content.content]
    torch.testing.assert_close(
        torch.tensor([t.logprob for t in streamed]),
        torch.tensor([t.logprob for t in content.content]),
        atol=1e-4,
        rtol=0,
    )
    # A token may hold part of a character: its bytes, joined, are the text.
    joined = b"".join(bytes(t.bytes or []) for t in content.content)
    assert joined.decode(errors="replace") == plain.choices[0].message.content
    for t in content.content:
        assert bytes(t.bytes or []).decode(errors="replace") == t.token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the likeliest
    templ = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tiny_tokenizer.encode(templ, add_special_tokens=False)
    out = hf_greedy(tiny_hf, ids, 10)
    visible = out[:-1] if out[-1] == EOS_ID else out
    ref = hf_logprobs(tiny_hf, ids + visible)[len(ids) - 1 :]
    got = torch.tensor([t.logprob for t in content.content])
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
    tiny_stack.wait_idle()


def test_batch_of_prompts_with_n_and_usage(tiny_stack: Stack, tiny_tokenizer: Any) -> None:
    prompts = ["the thin cat", "in the hat of"]
    resp = client(tiny_stack).completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0
    )
    assert [ch.index for ch in resp.choices] == [0, 1, 2, 3]
    texts = [ch.text for ch in resp.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: both samples agree
    one = client(tiny_stack).completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0
    )
    assert texts[2] == one.choices[0].text  # choices are prompt-major
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(tiny_tokenizer.encode(p)) for p in prompts)
    tiny_stack.wait_idle()


def test_stop_string_and_logit_bias(tiny_stack: Stack, tiny_tokenizer: Any) -> None:
    c = client(tiny_stack)
    free = c.completions.create(
        model=MODEL, prompt="a b c", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = text[5:7]
    assert len(stop) == 2
    cut = c.completions.create(
        model=MODEL,
        prompt="a b c",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    token = tiny_tokenizer.encode("q")[0]
    biased = c.completions.create(
        model=MODEL, prompt="a b c", max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == "qqqqq"
    tiny_stack.wait_idle()


def test_best_of_returns_the_likeliest_sample(tiny_stack: Stack) -> None:
    c = client(tiny_stack)
    args: dict[str, Any] = dict(
        model=MODEL, prompt="the thin", max_tokens=6, temperature=1.5, seed=21
    )
    best = c.completions.create(**args, best_of=4, n=1)
    # The same four samples (seeds 21..24), with their logprobs.
    every = c.completions.create(**args, n=4, logprobs=0)
    sums = []
    for ch in every.choices:
        assert ch.logprobs is not None and ch.logprobs.token_logprobs is not None
        sums.append(sum(float(x) for x in ch.logprobs.token_logprobs))
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == every.choices[max(range(4), key=sums.__getitem__)].text
    assert len({ch.text for ch in every.choices}) > 1
    tiny_stack.wait_idle()


def test_seeded_request_is_the_same_alone_and_in_a_busy_batch(tiny_stack: Stack) -> None:
    body = {
        "model": MODEL,
        "prompt": "the thin cat",
        "max_tokens": 12,
        "temperature": 1.2,
        "top_p": 0.9,
        "seed": 77,
        "ignore_eos": True,
    }

    async def main() -> tuple[str, str, int]:
        async with aiohttp.ClientSession() as s:
            url = f"{tiny_stack.base_url}/v1/completions"
            async with s.post(url, json=body) as r:
                alone = (await r.json())["choices"][0]["text"]
            streaming = [asyncio.Event() for _ in range(8)]
            finished: list[bool] = [False] * 8

            async def noise(i: int) -> None:
                other = {**body, "seed": None, "prompt": f"noise {i}", "max_tokens": 300}
                async with s.post(url, json={**other, "stream": True}) as r:
                    assert r.status == 200
                    async for raw in r.content:
                        if raw.startswith(b"data: "):
                            streaming[i].set()
                finished[i] = True

            tasks = [asyncio.create_task(noise(i)) for i in range(8)]
            for started in streaming:
                await started.wait()  # every noise request is decoding
            async with s.post(url, json=body) as r:
                seeded = (await r.json())["choices"][0]["text"]
            # The seeded request came and went while noise was still decoding beside it.
            still_running = finished.count(False)
            # The rest of the noise is not needed (up to 8 x 290 tokens more): closing a stream
            # aborts its request, and wait_idle below finds every slot freed all the same.
            for task in tasks:
                task.cancel()
            ends = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(e is None or isinstance(e, asyncio.CancelledError) for e in ends), ends
            return str(alone), str(seeded), still_running

    alone, busy, beside = asyncio.run(main())
    assert beside > 0  # it really shared a batch
    assert alone == busy
    tiny_stack.wait_idle()


def test_native_batch_with_logprobs(tiny_stack: Stack, tiny_hf: torch.nn.Module) -> None:
    ids = [[5, 60, 70, 80, 90], [7, 8, 9]]

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 0,
            "return_text_in_logprobs": True,
        }
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{tiny_stack.base_url}/generate", json=body) as r:
                assert r.status == 200, await r.text()
                plain = list(await r.json())
            async with s.post(
                f"{tiny_stack.base_url}/generate", json={**body, "stream": True}
            ) as r:
                events = await sse(r)
        return plain, events

    plain, events = asyncio.run(main())
    assert len(plain) == 2
    for i, out in enumerate(plain):
        meta = out["meta_info"]
        assert out["index"] == i and meta["completion_tokens"] == 4
        inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
        assert [t[1] for t in inp] == ids[i] and inp[0][0] is None
        assert [t[1] for t in outp] == out["output_ids"]
        assert all(isinstance(t[2], str) for t in outp)
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        ref = hf_logprobs(tiny_hf, ids[i] + out["output_ids"])
        got = torch.tensor([t[0] for t in inp[1:]] + [t[0] for t in outp])
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
    last = {}
    for e in events:
        last[e["index"]] = e
    assert [last[i]["output_ids"] for i in (0, 1)] == [o["output_ids"] for o in plain]
    assert all(
        # the same tokens computed in other batches: equal up to fp32 summation order
        math.isclose(
            last[i]["meta_info"]["output_token_logprobs"][-1][0],
            plain[i]["meta_info"]["output_token_logprobs"][-1][0],
            abs_tol=2e-3,
        )
        for i in (0, 1)
    )
    tiny_stack.wait_idle()
