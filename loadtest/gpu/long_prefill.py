"""The `long_prefill` section: one 100,000-token prompt's time to its first token, and where
the device spends it (issue 26's target: 7 s on an H100).

    python -m loadtest.gpu_bench --sections long_prefill

Llama-3.1-8B's shapes (dummy weights, bf16), `--max-prefill-tokens 16384` (7 chunks), the
attention backend of `RADIXSERVE_ATTENTION_BACKEND` (default auto): three prompts one after
another (each its own seed, so the radix cache serves none of it), then a fourth under
torch.profiler, summed by kernel family (loadtest/gpu/profile.py's families, and the largest
kernels by name). Then FlashInfer's attention of one 16,384-token chunk alone over cached
prefixes of 0-84K keys: its paged kernel (pages of one slot) against its ragged kernel over
contiguous keys, and the ragged kernel over the chunk's own keys merged with the paged
kernel over the prefix (SGLang's split), in TFLOP/s of causal attention.
"""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from loadtest import offline
from loadtest.gpu.models import LLAMA_3_1_8B, llama8b_dir
from loadtest.gpu.prefill import _events_ms
from loadtest.gpu.profile import family
from loadtest.gpu.scale import row_args

PROMPT = 100_000
# (new tokens, cached prefix) of one chunk: the 100K prompt's first, second, fourth and last
# chunks, and an 8K chunk over 4K cached
CHUNK_SHAPES = ((16_384, 0), (16_384, 16_384), (16_384, 49_152), (16_384, 83_616), (8_192, 4_096))


def _args(model: Path, seed: int) -> Any:
    """The scale section's 1 x 100,000 row (its chunk size and batch bounds), to the first
    token only, with a seed of its own."""
    a = row_args(model, 1, PROMPT)
    a.output_len, a.seed = 1, seed
    return a


def ttft_and_profile() -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    model = llama8b_dir(Path(tempfile.mkdtemp()))
    engine = offline.make_engine(_args(model, 11))
    runs = []
    for seed in (11, 12, 13):
        run = offline.run_throughput(engine, _args(model, seed))
        runs.append({"seed": seed, "ttft_s": run["ttft_ms_median"] / 1000})
        print(runs[-1], flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run = offline.run_throughput(engine, _args(model, 14))
    families: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        seconds = ev.device_time_total / 1e6
        if seconds > 0:
            families[family(ev.key)] += seconds
            kernels[ev.key[:90]] += seconds
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
    return {
        "attention_backend": os.environ.get("RADIXSERVE_ATTENTION_BACKEND", "auto"),
        "runs": runs,
        "profiled_ttft_s": run["ttft_ms_median"] / 1000,
        "device_s_by_family": dict(families),
        "device_s_top_kernels": top,
    }


def _chunk_point(
    fi: Any, ws: tuple[torch.Tensor, torch.Tensor], new: int, prefix: int
) -> dict[str, Any]:
    heads = LLAMA_3_1_8B["num_attention_heads"]
    kv_heads, dim = LLAMA_3_1_8B["num_key_value_heads"], LLAMA_3_1_8B["head_dim"]
    bf16, dev = torch.bfloat16, "cuda"
    total = new + prefix
    pages = (
        torch.randn(total, 1, kv_heads, dim, device=dev, dtype=bf16),
        torch.randn(total, 1, kv_heads, dim, device=dev, dtype=bf16),
    )
    k_all, v_all = pages[0][:, 0], pages[1][:, 0]
    q = torch.randn(new, heads, dim, device=dev, dtype=bf16)
    slots = torch.arange(total, dtype=torch.int32, device=dev)
    ones = torch.ones(1, dtype=torch.int32)
    qo = torch.tensor([0, new], dtype=torch.int32)
    paged = fi.BatchPrefillWithPagedKVCacheWrapper(ws[0], "NHD")
    paged.plan(
        qo, torch.tensor([0, total], dtype=torch.int32), slots, ones, heads, kv_heads, dim, 1,
        causal=True, q_data_type=bf16,
    )  # fmt: skip
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws[1], "NHD")
    ragged.plan(
        qo, torch.tensor([0, total], dtype=torch.int32), heads, kv_heads, dim, causal=True,
        q_data_type=bf16,
    )  # fmt: skip
    diff = ragged.run(q, k_all, v_all).float() - paged.run(q, pages).float()
    point: dict[str, Any] = {
        "new": new,
        "prefix": prefix,
        "paged_ms": _events_ms(lambda: paged.run(q, pages)),
        "ragged_ms": _events_ms(lambda: ragged.run(q, k_all, v_all)),
        "max_abs_diff": diff.abs().max().item(),
    }
    if prefix:
        # SGLang's split: ragged over the chunk's own keys, paged over the prefix, merged
        own = fi.BatchPrefillWithRaggedKVCacheWrapper(ws[1], "NHD")
        own.plan(qo, qo, heads, kv_heads, dim, causal=True, q_data_type=bf16)
        before = fi.BatchPrefillWithPagedKVCacheWrapper(ws[0], "NHD")
        before.plan(
            qo, torch.tensor([0, prefix], dtype=torch.int32), slots[:prefix], ones,
            heads, kv_heads, dim, 1, causal=False, q_data_type=bf16,
        )  # fmt: skip
        k_new, v_new = k_all[prefix:].contiguous(), v_all[prefix:].contiguous()

        def split() -> torch.Tensor:
            o1, s1 = own.run(q, k_new, v_new, return_lse=True)
            o2, s2 = before.run(q, pages, return_lse=True)
            merged: torch.Tensor = fi.merge_state(o1, s1, o2, s2)[0]
            return merged

        point["split_ms"] = _events_ms(split)
    flops = 4 * dim * heads * (new * prefix + new * (new + 1) / 2)
    for key in ("paged", "ragged", "split"):
        if f"{key}_ms" in point:
            point[f"{key}_tflops"] = flops / point[f"{key}_ms"] / 1e9
    return point


def chunk_attention() -> list[dict[str, Any]]:
    """FlashInfer's kernels on one chunk over a cached prefix (raises ImportError without it)."""
    import flashinfer

    ws = (
        torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"),
        torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"),
    )
    points = []
    for new, prefix in CHUNK_SHAPES:
        points.append(_chunk_point(flashinfer, ws, new, prefix))
        print(points[-1], flush=True)
        torch.cuda.empty_cache()
    return points


def long_prefill_section() -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), **ttft_and_profile()}
    torch.cuda.empty_cache()
    try:
        out["chunk_attention"] = chunk_attention()
    except ImportError as e:
        out["chunk_attention"] = {"error": f"import flashinfer: {e!r}"}
    return out
