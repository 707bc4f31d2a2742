"""A KV pool far too small for the load: requests are retracted and recomputed, and every one
still finishes with transformers' tokens, with the pool accounting checked every step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from tests.e2e.stack import Stack, start_stack
from tests.executor.helpers import hf_argmax_continuation

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def small_stack(
    redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack = start_stack(
        [
            "--model",
            str(tiny_model_dir),
            "--max-total-tokens",
            "100",
            "--check-integrity",
        ],
        tmp_path_factory.mktemp("small") / "serve.log",
        redis_url.rsplit("/", 1)[0] + "/3",
    )
    yield stack
    assert stack.stop() == 0, stack.log_tail()


def test_retraction_keeps_every_output_exact(small_stack: Stack, tiny_hf: torch.nn.Module) -> None:
    prompts = [
        torch.randint(0, 256, (12 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(8)
    ]
    new = 40

    async def one(s: aiohttp.ClientSession, ids: list[int]) -> list[int]:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        }
        async with s.post(f"{small_stack.base_url}/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            data: dict[str, Any] = await resp.json()
            return list(data["output_ids"])

    async def main() -> list[list[int]]:
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, p) for p in prompts))

    outputs = asyncio.run(main())
    for p, out in zip(prompts, outputs, strict=True):
        assert out == hf_argmax_continuation(tiny_hf, p, new)
    # 8 x (~15 + 40) tokens in a 100-slot pool: any two running together outgrow it, so the
    # executor had to retract however the requests happened to arrive.
    assert "retract" in small_stack.log_path.read_text()
    small_stack.wait_idle()
