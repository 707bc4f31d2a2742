"""The int4-weight (w4a16) kernels at Llama-3.1-8B's projection shapes (random weights, group
size 128), against bf16 on the same GPU.

For each projection (qkv, o, gate_up, down) and row counts 1 and 4: the bf16 product's best
time (cuBLAS or kernels/gemv), the int4 GEMV's best over a grid of launch configurations, the
bytes the int4 kernel reads per call (packed weight, scales, zero points) as TB/s and as a
share of the copy bandwidth, and its largest difference from the torch twin. Summed over the
four projections at one row, the ratio of bf16 to int4 time is what the projections alone
give batch-1 decode (the issue's target for the whole model: int4 >= 2.8x bf16). down_proj
is also timed with an act-order perm. Then prefill: the GEMM at 128 and 2,048 rows against
cuBLAS in bf16. Every time is a CUDA-graph replay (models/linear.py's _time_us), as decode
runs the kernels.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loadtest.gpu.bandwidth import copy_bandwidth

# (out_features, in_features) of Llama-3.1-8B's projections, qkv and gate_up fused
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
# (block_n, block_k (columns a step), num_warps, num_stages)
GEMV_CONFIGS = [
    (bn, bk, warps, 3) for bn in (4, 8) for bk in (1024, 2048) for warps in (4, 8)
] + [
    # tall tiles: a thread holds several rows of the same words, so each column of x it
    # loads serves all of them (at one row per thread, x costs a load per weight)
    (bn, bk, warps, stages)
    for bn in (16, 32, 64)
    for bk in (128, 256, 512)
    for warps in (2, 4)
    for stages in (3, 4)
]
# (block_m, block_n, block_k, num_warps, num_stages)
GEMM_CONFIGS = [
    (64, 64, 64, 4, 3),
    (64, 128, 32, 4, 4),
    (128, 128, 32, 8, 3),
    (128, 64, 64, 4, 3),
    (128, 256, 64, 8, 3),
    (16, 64, 128, 4, 3),
]


def _weights(n: int, k: int, gen: torch.Generator, act_order: bool = False) -> dict[str, Any]:
    from kernels.w4a16 import pack_int4

    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
    groups = -(-k // GROUP)
    scales = torch.rand(n, groups, device="cuda", generator=gen).mul_(0.002).add_(0.001)
    perm = torch.randperm(k, device="cuda", generator=gen).int() if act_order else None
    return {
        "qweight": pack_int4(q),
        "scales": scales.half(),
        "zeros": torch.randint(0, 16, (n, groups), device="cuda", generator=gen).to(torch.uint8),
        "group_size": GROUP,
        "perm": perm,
    }


def _bytes(w: dict[str, Any], x: torch.Tensor) -> int:
    t = [w["qweight"], w["scales"], w["zeros"], x] + ([w["perm"]] if w["perm"] is not None else [])
    return sum(a.numel() * a.element_size() for a in t)


def _gemv_rows(name: str, n: int, k: int, bw: float, gen: torch.Generator) -> dict[str, Any]:
    from kernels.gemv import gemv
    from kernels.w4a16 import w4a16_ref
    from kernels.w4a16_gemv import w4a16_gemv
    from services.executor.models.linear import _time_us

    dense = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).bfloat16()
    rows: dict[str, Any] = {}
    for act_order in (False, True) if name == "down" else (False,):
        w = _weights(n, k, gen, act_order)
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            bf16_us = min(_time_us(partial(F.linear, x, dense)), _time_us(partial(gemv, x, dense)))
            best: tuple[float, tuple[int, ...]] = (float("inf"), ())
            for bn, bk, warps, stages in GEMV_CONFIGS:
                run = partial(
                    w4a16_gemv, x, **w, block_n=bn, block_k=bk,
                    num_warps=warps, num_stages=stages,
                )  # fmt: skip
                try:
                    best = min(best, (_time_us(run), (bn, bk, warps, stages)))
                except Exception as e:  # out of registers or shared memory: the next one
                    rows.setdefault("skipped", []).append(f"{(bn, bk, warps, stages)}: {e}")
            us, cfg = best
            bn, bk, warps, stages = cfg
            got = w4a16_gemv(x, **w, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            read = _bytes(w, x)
            rows[f"{m}{'_act_order' if act_order else ''}"] = {
                "bf16_us": bf16_us,
                "int4_us": us,
                "speedup": bf16_us / us,
                "int4_TBps": read / us / 1e6,
                "int4_of_copy": read / us / 1e6 / (bw / 1e12),
                "best_config": {"block_n": bn, "block_k": bk, "num_warps": warps},
                "max_abs_diff": float((got.float() - w4a16_ref(x, **w).float()).abs().max()),
            }
    return rows


def _gemm_rows(n: int, k: int, gen: torch.Generator) -> dict[str, Any]:
    from kernels.w4a16_gemm import w4a16_gemm
    from services.executor.models.linear import _time_us

    dense = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).bfloat16()
    w = _weights(n, k, gen)
    rows: dict[str, Any] = {}
    for m in (128, 2048):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        bf16_us = _time_us(partial(F.linear, x, dense), reps=5)
        best: tuple[float, tuple[int, ...]] = (float("inf"), ())
        for bm, bn, bk, warps, stages in GEMM_CONFIGS:
            run = partial(
                w4a16_gemm, x, **w, block_m=bm, block_n=bn, block_k=bk,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
            try:
                best = min(best, (_time_us(run, reps=5), (bm, bn, bk, warps, stages)))
            except Exception as e:  # out of shared memory for this tile: try the next one
                rows.setdefault("skipped", []).append(f"{(bm, bn, bk, warps, stages)}: {e}")
        rows[str(m)] = {
            "bf16_us": bf16_us,
            "int4_us": best[0],
            "int4_over_bf16_time": best[0] / bf16_us,
            "best_config": best[1],
        }
    return rows


def w4a16_kernel_section() -> dict[str, Any]:
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gemv = {name: _gemv_rows(name, n, k, bw, gen) for name, (n, k) in LLAMA_8B.items()}
    bf16 = sum(r["1"]["bf16_us"] for r in gemv.values())
    int4 = sum(r["1"]["int4_us"] for r in gemv.values())
    return {
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bw / 1e12,
        "gemv": gemv,
        "layer_projections_1row": {"bf16_us": bf16, "int4_us": int4, "speedup": bf16 / int4},
        "gemm": {name: _gemm_rows(n, k, gen) for name, (n, k) in LLAMA_8B.items()},
    }


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """gpu_bench's summary lines for this section."""
    rows: list[tuple[str, str]] = []
    for name, by_rows in result.get("gemv", {}).items():
        for key, r in by_rows.items():
            if key == "skipped":
                continue
            rows.append(
                (
                    f"int4 GEMV {name}, {key.split('_')[0]} row(s)"
                    + (", act-order" if key.endswith("act_order") else ""),
                    f"{r['int4_us']:.1f} us vs bf16 {r['bf16_us']:.1f} us = {r['speedup']:.2f}x, "
                    f"{100 * r['int4_of_copy']:.0f}% of copy bandwidth",
                )
            )
    layer = result.get("layer_projections_1row")
    if layer:
        rows.append(("int4 vs bf16, a layer's projections at 1 row", f"{layer['speedup']:.2f}x"))
    for name, by_rows in result.get("gemm", {}).items():
        for m in ("128", "2048"):
            if m in by_rows:
                r = by_rows[m]
                rows.append(
                    (
                        f"int4 GEMM {name}, {m} rows",
                        f"{r['int4_us']:.0f} us = {r['int4_over_bf16_time']:.2f}x bf16's time",
                    )
                )
    return rows
