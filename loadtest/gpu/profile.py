"""Where a step's time goes on the GPU: kernel families, host time per step, prefill latency.

    python -m loadtest.gpu_bench --sections profile

Three measurements on Llama-3.1-8B shapes (dummy weights, bf16):
- a large decode batch (bs 256, context ~1,000): kernel time by family (GEMM, attention,
  the rest) per step, against the step's wall time, and how long the host blocks on the
  device each step (the rest of the step is host work the device may or may not hide);
- prefill latency of one prompt at several lengths (the floor under online TTFT);
- the same decode batch's host time per step with the device time excluded.
"""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from loadtest import offline
from loadtest.gpu.hosttime import HostTimes
from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.timeline import abort_all, start_decoding

FAMILIES = (
    ("gemm", ("gemm", "gemv", "cutlass", "sm90", "matmul", "cublas", "nvjet")),
    ("attention", ("attention", "attn", "_fwd_", "decode_", "extend_")),
    ("norm_rotary_act", ("rmsnorm", "rotary", "silu", "store_kv", "norm")),
    ("sampling", ("argmax", "softmax", "multinomial", "sort", "topk")),
)


def family(kernel: str) -> str:
    name = kernel.lower()
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def _engine(model: Path, *extra: str) -> Any:
    args = offline.parse_args(
        ["throughput", "--model", str(model), "--load-format", "dummy", *extra]
    )
    return offline.make_engine(args)


def decode_breakdown(engine: Any, host: HostTimes, bs: int, ctx: int, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.runner.vocab_size
    reqs = []
    for i in range(bs):
        ids = [(7 * i + j) % (vocab - 10) + 10 for j in range(ctx)]
        reqs.append(offline.request(f"p{i}", ids, 4 * steps + 64))
    start_decoding(engine, reqs, 8)
    host.start()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    blocked = host.seconds["wait"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    by_family: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        us = e.device_time_total / steps
        by_family[family(e.key)] += us
        top.append((us, e.key[:90]))
    abort_all(engine)
    return {
        "batch": bs,
        "context": ctx,
        "step_ms": 1000 * wall / steps,
        "host_blocked_ms_per_step": 1000 * blocked / steps,
        "host_busy_ms_per_step": 1000 * (wall - blocked) / steps,
        "kernel_ms_per_step": {k: v / 1000 for k, v in sorted(by_family.items())},
        "kernel_ms_total": sum(by_family.values()) / 1000,
        "top_kernels_us": [(round(us, 1), name) for us, name in sorted(top, reverse=True)[:12]],
    }


def prefill_latency(engine: Any, lengths: tuple[int, ...]) -> dict[str, float]:
    """Milliseconds from submit to the first token of one prompt alone (best of 3)."""
    vocab = engine.runner.vocab_size
    out: dict[str, float] = {}
    for n in lengths:
        best = float("inf")
        for rep in range(3):
            ids = [(13 * j + rep * 7 + n) % (vocab - 10) + 10 for j in range(n)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.submit(offline.request(f"pf{n}-{rep}", ids, 1))
            while engine.has_work():
                engine.step()
            best = min(best, time.perf_counter() - t0)
        out[str(n)] = 1000 * best
    return out


def extend_host_profile(engine: Any, n: int, reps: int = 3) -> dict[str, Any]:
    """Where the host's time goes in the prefill of one n-token prompt (cProfile, tottime)."""
    import cProfile
    import pstats

    vocab = engine.runner.vocab_size
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for rep in range(reps):
        ids = [(11 * j + rep) % (vocab - 10) + 10 for j in range(n)]
        engine.submit(offline.request(f"hp{n}-{rep}", ids, 1))
        prof.enable()
        while engine.has_work():
            engine.step()
        prof.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((tt / reps, ct / reps, nc // reps, f"{Path(file).name}:{line}:{fn}"))
    rows.sort(reverse=True)
    return {
        "tokens": n,
        "wall_ms": 1000 * wall,
        "top_tottime_ms": [
            (round(1000 * tt, 3), round(1000 * ct, 3), calls, where)
            for tt, ct, calls, where in rows[:30]
        ],
    }


def _time_graphed(call: Any, reps: int = 20) -> float:
    """Microseconds per call, `reps` calls replayed from one CUDA graph."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


# (block_n, num_stages, num_warps) of stage 1
DECODE_CONFIGS = ((32, 2, 4), (64, 2, 4), (32, 3, 4), (64, 3, 4), (32, 4, 4), (64, 4, 8))


def decode_attention_grid() -> list[dict[str, Any]]:
    """The decode attention kernel alone over (bs, context) shapes for several launch
    configurations: microseconds per call and K/V bytes read per second."""
    from functools import partial

    from kernels.decode_attention import DecodeWorkspace, decode_attention, num_kv_splits_for
    from services.executor.attention.triton_backend import TritonBackend

    heads, kv_heads, d = 32, 8, 128
    backend = TritonBackend()
    out: list[dict[str, Any]] = []
    for bs, ctx in ((1, 256), (1, 2048), (8, 1024), (64, 2048), (256, 1024), (256, 2048)):
        slots = bs * ctx + 1
        k = torch.randn(slots, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        perm = torch.randperm(slots - 1, device="cuda")[: bs * ctx]
        seq = torch.full((bs,), ctx, dtype=torch.int64, device="cuda")
        cap = backend._split_cap(bs, kv_heads, torch.device("cuda"))  # the grid it launches
        base = {
            "q": torch.randn(bs, heads, d, dtype=torch.bfloat16, device="cuda"),
            "k_buffer": k,
            "v_buffer": torch.randn_like(k),
            "req_to_token": perm.view(bs, ctx).to(torch.int32),
            "req_rows": torch.arange(bs, device="cuda"),
            "seq_lens": seq,
            "workspace": DecodeWorkspace.allocate(
                max_batch_size=bs, num_heads=heads, head_dim=d, max_kv_splits=cap, device="cuda"
            ),
            "sm_scale": d**-0.5,
        }
        bytes_read = 2 * bs * ctx * kv_heads * d * 2
        for min_split in (32, 64, 128, 256):
            splits = num_kv_splits_for(seq, max_kv_splits=cap, min_split_len=min_split)
            for block_n, stages, warps in DECODE_CONFIGS:
                call = partial(
                    decode_attention,
                    **base,
                    num_kv_splits=splits,
                    block_n=block_n,
                    num_stages=stages,
                    num_warps=warps,
                )
                row: dict[str, Any] = {
                    "bs": bs,
                    "ctx": ctx,
                    "min_split": min_split,
                    "cap": cap,
                    "block_n": block_n,
                    "stages": stages,
                    "warps": warps,
                }
                try:
                    us = _time_graphed(call)
                except Exception as e:  # a configuration this GPU cannot run is reported
                    row["error"] = str(e)[:200]
                else:
                    row.update(us=round(us, 2), TBps=round(bytes_read / us / 1e6, 3))
                out.append(row)
    return out


def profile_section() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root)
    engine = _engine(model, "--disable-radix-cache")
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    result["prefill_ms"] = prefill_latency(engine, (128, 512, 1024, 2048, 4096))
    result["extend_host_512"] = extend_host_profile(engine, 512)
    host = HostTimes(engine)
    result["decode_bs256_ctx1024"] = decode_breakdown(engine, host, 256, 1024, 32)
    result["decode_bs256_ctx2048"] = decode_breakdown(engine, host, 256, 2048, 16)
    result["decode_bs8_ctx1024"] = decode_breakdown(engine, host, 8, 1024, 64)
    result["decode_bs1_ctx256"] = decode_breakdown(engine, host, 1, 256, 64)
    del engine
    torch.cuda.empty_cache()
    result["decode_attention_grid"] = decode_attention_grid()
    return result
