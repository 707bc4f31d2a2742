"""The newer model families through every service with the real `openai` client: a tiny
random DeepSeek-V2 (latent attention and MoE) and Gemma 3 (sliding window, soft cap), each
served by its own `radixserve serve` on the CPU. These two are the families whose KV pool
differs from the dense one (the latent cache; windowed layers beside global ones). Qwen3-MoE
and Phi-3 differ only inside the forward pass, which tests/executor compares with
transformers (test_models.py; the engine's chunked prefill, retraction and cache reuse on
MoE in test_engine_moe.py, on Phi-3 in test_phi3.py): a stack a family would cost about
15 s of the suite.

Greedy chat tokens (read back from the chat logprobs' bytes), their logprobs and completion
text equal transformers' greedy `generate` (and forward) on the same weights; streamed
answers equal unstreamed ones.
A family's four requests are sent at once (the executor may batch them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, NamedTuple

import openai
import pytest
import redis
import torch

from tests.e2e.stack import Stack, start_stack
from tests.executor.helpers import (
    EOS_ID,
    MERGES,
    _byte_to_unicode,
    hf_greedy,
    make_hf_model,
    make_tokenizer,
    write_tiny_model,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SEED = 0
DB = "/7"
CHAT_TOKENS = 16
COMPLETION_TOKENS = 12
# An untied output head keeps these random models from repeating their last token (a tied
# one scores a token's own embedding highest), so greedy answers vary from token to token.
UNTIED = {"tie_word_embeddings": False}
# arch -> overrides for the HF config: each family's distinguishing parts switched on.
FAMILIES: dict[str, dict[str, Any]] = {
    # layer 0 dense, layer 1 routed experts plus a shared one
    "deepseek_v2": {**UNTIED, "first_k_dense_replace": 1, "n_shared_experts": 1},
    # window 8 in layers 0 and 2, final soft cap 6, RoPE per layer type
    "gemma3": UNTIED,
}
CHAT = [{"role": "user", "content": "the thin cat sat in the hat"}]
PROMPT = "in the thin hat, the cat sat on the mat"

_UNICODE_TO_BYTE = {c: b for b, c in enumerate(_byte_to_unicode())}


class Family(NamedTuple):
    arch: str
    stack: Stack
    hf: torch.nn.Module


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Family]:
    arch: str = request.param
    model_dir = write_tiny_model(tmp_path_factory.mktemp(arch), arch, SEED, **FAMILIES[arch])
    url = redis_url.rsplit("/", 1)[0] + DB
    redis.Redis.from_url(url).flushdb()  # the previous family's stack left its streams here
    stack = start_stack(
        [
            "--model",
            str(model_dir),
            "--served-model-name",
            arch,
            "--max-total-tokens",
            "2048",
            "--check-integrity",
        ],
        tmp_path_factory.mktemp("logs") / f"{arch}.log",
        url,
    )
    yield Family(arch, stack, make_hf_model(arch, SEED, **FAMILIES[arch]))
    code = stack.stop()
    assert code == 0, f"serve exited with {code} on Ctrl-C\n{stack.log_tail()}"
    assert "Traceback" not in stack.log_path.read_text(errors="replace"), stack.log_tail(200)


def token_id(tok: Any, raw: list[int]) -> int:
    """The tiny vocabulary's id whose bytes (as the chat logprobs give them) are `raw`: a
    byte, a merge, or a special token (whose bytes are its name)."""
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        if i < 256 + len(MERGES):
            if bytes(_UNICODE_TO_BYTE[c] for c in piece) == bytes(raw):
                return i
        elif piece.encode() == bytes(raw):
            return i
    raise AssertionError(f"no token has the bytes {bytes(raw)!r}")


def chat_prompt_ids(tok: Any) -> list[int]:
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def hf_logprobs(hf: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """transformers' log p of each of `out`'s tokens after `prompt` and those before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out)[:, None]).squeeze(1)


def reference(fam: Family, tok: Any, ids: list[int], n: int) -> tuple[list[int], str, str]:
    """transformers' greedy ids (EOS included when it stops there), visible text, finish."""
    out = hf_greedy(fam.hf, ids, n)
    finish = "stop" if out and out[-1] == EOS_ID else "length"
    return out, tok.decode(out, skip_special_tokens=True), finish


async def ask(stack: Stack, arch: str) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    chat: dict[str, Any] = dict(
        model=arch, messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0, logprobs=True
    )
    completion: dict[str, Any] = dict(
        model=arch, prompt=PROMPT, max_tokens=COMPLETION_TOKENS, temperature=0
    )

    async def chunks(stream: Any) -> list[Any]:
        return [c async for c in await stream]

    async with client:
        return list(
            await asyncio.gather(
                client.chat.completions.create(**chat),
                chunks(client.chat.completions.create(**chat, stream=True)),
                client.completions.create(**completion),
                chunks(client.completions.create(**completion, stream=True)),
            )
        )


def test_greedy_answers_match_transformers(family: Family, tokenizer: Any) -> None:
    tok = tokenizer
    chat, chat_chunks, completion, completion_chunks = asyncio.run(ask(family.stack, family.arch))

    chat_ids = chat_prompt_ids(tok)
    want_ids, want_text, want_finish = reference(family, tok, chat_ids, CHAT_TOKENS)
    assert len(want_ids) >= 8 and len(set(want_ids)) >= 4, f"a weak reference: {want_ids}"
    choice = chat.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    got_ids = [token_id(tok, e.bytes) for e in choice.logprobs.content]
    assert got_ids == want_ids, family.arch
    # the logprobs too: a monotonic error (Gemma's final soft cap) leaves greedy tokens alone
    got_lps = torch.tensor([e.logprob for e in choice.logprobs.content])
    torch.testing.assert_close(
        got_lps, hf_logprobs(family.hf, chat_ids, want_ids), atol=2e-3, rtol=0
    )
    assert (choice.message.content, choice.finish_reason) == (want_text, want_finish)
    assert chat.usage is not None and chat.usage.completion_tokens == len(want_ids)
    assert chat.usage.prompt_tokens == len(chat_ids)

    streamed = [c.choices[0] for c in chat_chunks if c.choices]
    streamed_ids = [
        token_id(tok, e.bytes)
        for c in streamed
        if c.logprobs is not None and c.logprobs.content
        for e in c.logprobs.content
    ]
    assert streamed_ids == want_ids
    assert "".join(c.delta.content or "" for c in streamed) == choice.message.content
    assert streamed[-1].finish_reason == want_finish

    prompt_ids = tok.encode(PROMPT)
    assert len(prompt_ids) > 16  # past Phi-3's original context and Gemma's window
    _, want_text, want_finish = reference(family, tok, prompt_ids, COMPLETION_TOKENS)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (
        want_text,
        want_finish,
    )
    assert want_text
    streamed_c = [c.choices[0] for c in completion_chunks if c.choices]
    assert "".join(c.text for c in streamed_c) == completion.choices[0].text
    assert streamed_c[-1].finish_reason == want_finish
    family.stack.wait_idle()
