"""The offline throughput run through the public `radixserve.Engine` (`python -m
loadtest.offline throughput --through engine`): the same prompts as the internal path, each
sent with `async_generate`, all at once, so what the public API adds (validation, the
tokenizer's and detokenizer's cores, the stepping thread, results) is what the two runs differ
by."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from loadtest.offline_prompts import throughput_prompts
from radixserve import Engine


def make_public_engine(a: argparse.Namespace) -> Engine:
    return Engine(
        a.model or None,
        show_progress=False,
        device=a.device,
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        load_format=a.load_format,
        attention_backend=a.attention_backend,
        disable_cuda_graph=a.disable_cuda_graph,
        max_total_tokens=a.max_total_tokens,
        mem_fraction_static=a.mem_fraction_static,
        max_running_requests=a.max_running_requests,
        max_prefill_tokens=a.max_prefill_tokens,
        disable_radix_cache=a.disable_radix_cache,
    )


def run_throughput_public(engine: Engine, a: argparse.Namespace) -> dict[str, Any]:
    # Ids the tokenizer knows (the public API checks them); their values do not change speed.
    vocab = min(engine.pipeline.engine.runner.vocab_size, engine.tokenization.vocab_size)
    prompts = throughput_prompts(random.Random(a.seed), a, vocab)

    def params(out_len: int) -> dict[str, Any]:
        return {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}

    engine.generate(input_ids=[11] * 16, sampling_params=params(4))  # warm-up, as internally

    async def run_all() -> list[Any]:
        return await asyncio.gather(
            *(engine.async_generate(input_ids=ids, sampling_params=params(n)) for ids, n in prompts)
        )

    start = time.perf_counter()
    results = asyncio.run(run_all())
    elapsed = time.perf_counter() - start
    out_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    in_tokens = sum(len(ids) for ids, _ in prompts)
    return {
        "requests": len(prompts),
        "finished": sum(r["meta_info"]["finish_reason"]["type"] == "length" for r in results),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (in_tokens + out_tokens) / elapsed,
        "request_s": len(prompts) / elapsed,
        "through": "engine",
    }
