"""Where a prefill's time goes: the floor under TTFT and under the offline run's EXTEND steps.

    python -m loadtest.gpu_bench --sections prefill

On Llama-3.1-8B shapes (dummy weights, bf16):
- one prompt's prefill at 2,048 and 4,096 tokens: kernel time by family (GEMM, attention, the
  rest) against the step's wall time;
- the projections alone (torch.nn.functional.linear) at those token counts: TFLOP/s, the rate
  the GEMM share can reach at best;
- the extend attention kernel alone over prefill shapes and launch configurations: TFLOP/s
  (causal FLOPs only: 4 * head_dim per query-key pair seen, per head);
- GPU memory: the card, the weights, the KV pool, and the peak the allocator reserved over a
  full-budget EXTEND and the largest decode batch: what --mem-fraction-static must leave.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from loadtest import offline
from loadtest.gpu.hosttime import HostTimes
from loadtest.gpu.models import LLAMA_3_1_8B, llama8b_dir
from loadtest.gpu.profile import family
from loadtest.gpu.timeline import abort_all, device_intervals, start_decoding, summarize

# (block_m, block_n, num_warps, num_stages, heavy_first); the first is the old default
EXTEND_CONFIGS = (
    (64, 64, 4, 3, False),
    (64, 64, 4, 3, True),
    (64, 64, 8, 3, True),
    (64, 64, 4, 4, True),
    (64, 32, 4, 3, True),
    (64, 128, 4, 3, True),
    (128, 64, 4, 3, True),
    (128, 64, 8, 3, True),
    (128, 64, 8, 2, True),
    (128, 64, 8, 4, True),
    (128, 32, 4, 3, True),
    (128, 32, 8, 3, True),
    (128, 128, 8, 3, True),
)
# (name, prefix_lens, extend_lens): one prompt alone; an offline-sized chunk of four prompts;
# the second chunks of four long prompts, after cached prefixes
EXTEND_SHAPES = (
    ("1x2048", [0], [2048]),
    ("1x4096", [0], [4096]),
    ("4x2048", [0] * 4, [2048] * 4),
    ("4x1024_after_3072", [3072] * 4, [1024] * 4),
)


def _events_ms(call: Any, reps: int = 10) -> float:
    for _ in range(2):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def extend_attention_grid() -> list[dict[str, Any]]:
    from functools import partial

    from kernels.extend_attention import extend_attention

    heads, kv_heads, d = 32, 8, 128
    out: list[dict[str, Any]] = []
    for name, prefix, extend in EXTEND_SHAPES:
        bs = len(prefix)
        seq = [p + e for p, e in zip(prefix, extend, strict=True)]
        slots = sum(seq) + 1
        k = torch.randn(slots, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        table = torch.zeros(bs, max(seq), dtype=torch.int32, device="cuda")
        # Slots as a fresh pool hands them out: each request's run contiguous.
        at = 0
        for b, n in enumerate(seq):
            table[b, :n] = torch.arange(at, at + n, device="cuda")
            at += n
        n_q = sum(extend)
        starts = [sum(extend[:i]) for i in range(bs)]

        def ints(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device="cuda")

        base = {
            "q": torch.randn(n_q, heads, d, dtype=torch.bfloat16, device="cuda"),
            "k_buffer": k,
            "v_buffer": torch.randn_like(k),
            "req_to_token": table,
            "req_rows": torch.arange(bs, device="cuda"),
            "prefix_lens": ints(prefix),
            "extend_lens": ints(extend),
            "extend_starts": ints(starts),
            "max_extend_len": max(extend),
            "sm_scale": d**-0.5,
        }
        pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix, extend, strict=True))
        flops = 4 * d * heads * pairs
        for bm, bn, warps, stages, heavy in EXTEND_CONFIGS:
            row: dict[str, Any] = {
                "shape": name,
                "block_m": bm,
                "block_n": bn,
                "warps": warps,
                "stages": stages,
                "heavy_first": heavy,
            }
            call = partial(
                extend_attention,
                **base,
                block_m=bm,
                block_n=bn,
                num_warps=warps,
                num_stages=stages,
                heavy_first=heavy,
            )
            try:
                ms = _events_ms(call)
            except Exception as e:  # a configuration this GPU cannot run is reported
                row["error"] = str(e)[:200]
            else:
                row.update(ms=round(ms, 3), TFLOPs=round(flops / ms / 1e9, 1))
            out.append(row)
    return out


def gemm_rates() -> dict[str, Any]:
    """TFLOP/s of each projection of a Llama-3.1-8B layer at prefill token counts."""
    import torch.nn.functional as F

    c = LLAMA_3_1_8B
    h, inter = c["hidden_size"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * c["head_dim"]
    shapes = {"qkv": (h, qkv), "o": (h, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    out: dict[str, Any] = {}
    for m in (2048, 4096, 8192):
        for name, (k, n) in shapes.items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            ms = _events_ms(lambda x=x, w=w: F.linear(x, w))
            out[f"{name}_m{m}"] = {"ms": round(ms, 3), "TFLOPs": round(2 * m * k * n / ms / 1e9, 1)}
    return out


def prefill_breakdown(engine: Any, host: HostTimes, n: int) -> dict[str, Any]:
    """One n-token prompt alone: wall time to its first token and kernel time by family."""
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.runner.vocab_size

    def once(tag: str) -> float:
        ids = [(17 * j + n) % (vocab - 10) + 10 for j in range(n)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.submit(offline.request(f"pb{n}-{tag}", ids, 1))
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t0

    wall = min(once(str(i)) for i in range(3))
    host.start()
    host_wall = once("host")
    phases = {k: round(1000 * v, 3) for k, v in sorted(host.seconds.items())}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        once("prof")
    with tempfile.TemporaryDirectory() as d:
        trace_path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        timeline = summarize(device_intervals(json.loads(trace_path.read_text())), 1)
    by_family: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        by_family[family(e.key)] += e.device_time_total
        top.append((e.device_time_total, e.key[:90]))
    return {
        "tokens": n,
        "wall_ms": 1000 * wall,
        "kernel_ms": {k: round(v / 1000, 3) for k, v in sorted(by_family.items())},
        "kernel_ms_total": sum(by_family.values()) / 1000,
        # The device's window (first kernel to last) and its idle stretches: the wall time
        # the kernels do not cover is either outside the window (host before the first
        # launch, after the last) or in these gaps.
        "device_timeline": {k: v for k, v in timeline.items() if k != "top_kernels_us_per_step"},
        "host_phases_ms": {"wall": round(1000 * host_wall, 3), **phases},
        "top_kernels_ms": [(round(us / 1000, 3), k) for us, k in sorted(top, reverse=True)[:12]],
    }


# (block_m, block_n, num_warps, num_stages) tried inside the model
IN_MODEL_CONFIGS = (
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (128, 32, 4, 3),
    (64, 32, 4, 3),
    (128, 64, 8, 3),
)


def extend_configs_in_model(engine: Any, lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    """The extend attention kernel's device time per prefill inside the model, for each
    launch configuration: the pool's slots, q's strides and the cache state are the model's,
    which the kernel alone (extend_attention_grid) does not reproduce."""
    from functools import partial

    from torch.profiler import ProfilerActivity, profile

    from kernels.extend_attention import extend_attention
    from services.executor.attention import triton_backend

    vocab = engine.runner.vocab_size
    out: list[dict[str, Any]] = []
    try:
        for bm, bn, warps, stages in IN_MODEL_CONFIGS:
            triton_backend.extend_attention = partial(
                extend_attention, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages
            )
            for n in lengths:
                for rep in range(2):  # the first compiles
                    ids = [(19 * j + n + rep) % (vocab - 10) + 10 for j in range(n)]
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        engine.submit(offline.request(f"cfg{bm}-{bn}-{n}-{rep}", ids, 1))
                        while engine.has_work():
                            engine.step()
                        torch.cuda.synchronize()
                us = sum(
                    e.device_time_total for e in prof.key_averages() if "_extend_kernel" in e.key
                )
                out.append(
                    {"block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                     "tokens": n, "extend_kernel_ms": round(us / 1000, 3)}
                )  # fmt: skip
    finally:
        triton_backend.extend_attention = extend_attention
    return out


def memory(engine: Any) -> dict[str, Any]:
    """Peak reserved memory over a full-budget EXTEND and the largest graphed decode batch."""
    gib = 2**30
    vocab = engine.runner.vocab_size
    budget = engine.policy.max_prefill_tokens
    torch.cuda.reset_peak_memory_stats()
    reqs = [
        offline.request(f"m{i}", [(29 * j + i) % (vocab - 10) + 10 for j in range(budget // 2)], 8)
        for i in range(2)
    ]
    for r in reqs:
        engine.submit(r)
    while engine.has_work():
        engine.step()
    bs = engine.policy.max_running
    start_decoding(engine, [offline.request(f"d{i}", [10 + i, 11, 12], 64) for i in range(bs)], 8)
    abort_all(engine)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    pool = engine.policy.kv.nbytes()
    peak = torch.cuda.max_memory_reserved()
    return {
        "total_gib": total / gib,
        "free_now_gib": free / gib,
        "weights_gib": weights / gib,
        "kv_pool_gib": pool / gib,
        "kv_pool_tokens": engine.policy.kv.num_slots,
        "peak_reserved_gib": peak / gib,
        "peak_beyond_weights_and_pool_gib": (peak - weights - pool) / gib,
        "outside_torch_gib": (total - free - torch.cuda.memory_reserved()) / gib,
    }


def prefill_section() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root)
    args = offline.parse_args(
        ["throughput", "--model", str(model), "--load-format", "dummy", "--disable-radix-cache"]
    )
    engine = offline.make_engine(args)
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    result["memory"] = memory(engine)
    host = HostTimes(engine)
    result["prefill_2048"] = prefill_breakdown(engine, host, 2048)
    result["prefill_4096"] = prefill_breakdown(engine, host, 4096)
    result["extend_configs_in_model"] = extend_configs_in_model(engine, (2048, 4096))
    del engine
    torch.cuda.empty_cache()
    result["gemm"] = gemm_rates()
    result["extend_attention_grid"] = extend_attention_grid()
    return result
