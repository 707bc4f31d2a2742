"""The MLA decode kernel's bandwidth: latent-cache bytes read per step / time, against the
device-to-device copy bandwidth measured in the same run.

DeepSeek-V2-Lite's attention shapes (16 heads, kv_lora_rank 512, rope 64, bf16), batches of
1, 64 and 256 at a few context lengths, each request's slots scattered over the pool. Each
point is timed two ways: through TritonBackend.forward_mla as a decode step launches it (its
split choice, the latent store of the new token included), and the kernel alone over a small
grid of launch configurations (keys per step, warps, chunk length), best one reported. Every
timing replays a CUDA graph of REPS launches, so launch overhead is not in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kernels.decode_attention import DecodeWorkspace, num_kv_splits_for
from kernels.mla_decode import mla_decode
from services.executor.attention.triton_backend import TritonBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool

HEADS, RANK, ROPE = 16, 512, 64
BATCHES = (1, 64, 256)
CONTEXTS = (1024, 4096, 16384)
MAX_POOL_TOKENS = 2**22  # 4.8 GB of bf16 rows: bs 256 stops at 16K keys
REPS = 20
# (block_n, num_warps, min_split_len) tried on the kernel alone
CONFIGS = [(16, 4, 32), (32, 4, 32), (32, 4, 256), (64, 4, 256), (32, 8, 256), (16, 4, 128)]


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n / graph_seconds(lambda: dst.copy_(src), reps=10)


def graph_seconds(fn: Callable[[], object], reps: int = REPS) -> float:
    """Seconds per call of `fn`, replayed `reps` times in one CUDA graph (median of 5)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / reps)
    return sorted(times)[2]


def decode_batch(bs: int, context: int, gen: torch.Generator) -> ForwardBatch:
    """bs requests of `context` tokens each on shuffled slots of a latent pool."""
    total = bs * context
    pool = KVPool(total, 1, 1, RANK + ROPE, torch.bfloat16, "cuda", values=False)
    pool.k_buffers[0].normal_(generator=gen)
    table = ReqToTokenPool(bs, context, "cuda", pad_slot=pool.pad_slot)
    perm = torch.randperm(total, device="cuda", generator=gen).view(bs, context)
    table.req_to_token[:bs] = perm
    rows = torch.arange(bs, device="cuda")
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64, device="cuda"),
        positions=torch.full((bs,), context - 1, dtype=torch.int64, device="cuda"),
        out_cache_loc=perm[:, -1].contiguous(),
        req_rows=rows,
        seq_lens=torch.full((bs,), context, dtype=torch.int64, device="cuda"),
        prefix_lens_cpu=[context - 1] * bs,
        extend_lens_cpu=[1] * bs,
        kv_pool=pool,
        req_to_token=table,
    )


def measure(bs: int, context: int, copy_bw: float) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(bs + context)
    batch = decode_batch(bs, context, gen)
    q = torch.randn(bs, HEADS, RANK + ROPE, dtype=torch.bfloat16, device="cuda", generator=gen)
    latent = batch.kv_pool.k_buffers[0][batch.out_cache_loc].clone()
    scale = (128 + ROPE) ** -0.5
    read = bs * context * (RANK + ROPE) * 2  # latent-cache bytes per step

    backend = TritonBackend()
    backend.reserve_decode(max_batch_size=bs, num_heads=HEADS, head_dim=RANK, device="cuda")

    def step() -> None:
        backend.init_forward_metadata(batch)
        backend.forward_mla(q, latent, 0, batch, scale, RANK)

    backend_s = graph_seconds(step)
    best: tuple[float, tuple[int, int, int]] | None = None
    table, out = batch.req_to_token.req_to_token, q.new_empty(bs, HEADS, RANK)
    for block_n, warps, split_len in CONFIGS:
        splits = num_kv_splits_for(batch.seq_lens, max_kv_splits=32, min_split_len=split_len)
        ws = DecodeWorkspace.allocate(
            max_batch_size=bs, num_heads=HEADS, head_dim=RANK, max_kv_splits=32, device="cuda"
        )

        def kernel(
            splits: torch.Tensor = splits,
            ws: DecodeWorkspace = ws,
            bn: int = block_n,
            w: int = warps,
        ) -> None:
            mla_decode(
                q=q, buffer=batch.kv_pool.k_buffers[0], rank=RANK, req_to_token=table,
                req_rows=batch.req_rows, seq_lens=batch.seq_lens, num_kv_splits=splits,
                workspace=ws, sm_scale=scale, out=out, block_n=bn, num_warps=w,
            )  # fmt: skip

        try:
            s = graph_seconds(kernel)
        except Exception as e:  # e.g. out of shared memory for this tile: report, go on
            print(f"mla_kernel bs {bs} ctx {context} {block_n}/{warps}/{split_len}: {e}")
            continue
        if best is None or s < best[0]:
            best = (s, (block_n, warps, split_len))
    result: dict[str, Any] = {
        "bs": bs,
        "context": context,
        "latent_bytes_per_step": read,
        "backend_us": 1e6 * backend_s,
        "backend_TBps": read / backend_s / 1e12,
        "backend_of_copy": read / backend_s / copy_bw,
    }
    if best is not None:
        s, (block_n, warps, split_len) = best
        result |= {
            "best_us": 1e6 * s,
            "best_TBps": read / s / 1e12,
            "best_of_copy": read / s / copy_bw,
            "best_config": {"block_n": block_n, "num_warps": warps, "min_split_len": split_len},
        }
    return result


def mla_kernel_section() -> dict[str, Any]:
    t0 = time.time()
    copy_bw = copy_bandwidth()
    points = []
    for bs in BATCHES:
        for ctx in CONTEXTS:
            if bs * ctx <= MAX_POOL_TOKENS:
                points.append(measure(bs, ctx, copy_bw))
                torch.cuda.empty_cache()  # the last point's pool, before the next one
    return {
        "gpu": torch.cuda.get_device_name(),
        "shapes": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "dtype": "bfloat16"},
        "copy_bandwidth_TBps": copy_bw / 1e12,
        "points": points,
        "seconds": time.time() - t0,
    }
