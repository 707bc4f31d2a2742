"""The int4-weight (w4a16) kernels at Llama-3.1-8B's projection shapes (random weights, group
size 128), against bf16 on the same GPU.

For each projection (qkv, o, gate_up, down) and row counts 1 and 4: the bf16 product's best
time (cuBLAS or kernels/gemv), the int4 GEMV's best over a grid of launch configurations, the
bytes the int4 kernel reads per call (packed weight, scales, zero points) as TB/s and as a
share of the copy bandwidth, and its largest difference from the torch twin. Summed over the
four projections at one row, the ratio of bf16 to int4 time is what the projections alone
give batch-1 decode (the issue's target for the whole model: int4 >= 2.8x bf16). down_proj
is also timed with an act-order perm.

Then prefill (`prefill`), per projection and for down_proj with an act-order perm: the
dequantise kernel alone (kernels/w4a16_dequant, the whole weight to bf16: the launcher's
default tile and the best of a small grid, bytes read + written as GB/s and as a share of
the copy bandwidth), and at PREFILL_ROWS rows the tensor-core GEMM's best over its grid,
dequantise + cuBLAS (kernels/w4a16_matmul past its GEMM rows: slices of the weight expanded,
then torch.mm; with act-order, x's columns gathered too) and bf16 cuBLAS. `crossover_m` is
the row count from which dequantise + cuBLAS beats the GEMM at every larger measured count;
`gemm_max_m` (the largest crossover over the projections, less one) is the figure
kernels/w4a16_matmul.GEMM_MAX_M should follow. Every time is a CUDA-graph replay
(models/linear.py's _time_us), as decode runs the kernels.
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
    (bn, bk, warps, 3) for bn in (2, 4, 8) for bk in (512, 1024, 2048) for warps in (2, 4)
]
# rows of x for the prefill paths: just past the GEMV's rows (8) to a prefill chunk; the GEMM
# tiles compile once per row count that is not a multiple of 16 (Triton specialises on it)
PREFILL_ROWS = (8, 16, 32, 128, 512, 2048)
# kernels/w4a16_dequant's (block_n, block_w, num_warps), beside the launcher's default (1 x
# 256, 1 warp; 2 x 128 with a perm); the old default (16 rows x 64 words, 4 warps) last
DEQUANT_CONFIGS = [
    (1, 256, 1), (1, 128, 1), (1, 512, 1), (1, 512, 2), (2, 256, 2), (2, 128, 1), (4, 256, 4),
    (16, 64, 4),
]  # fmt: skip
# (block_m, block_n, block_k, num_warps, num_stages): the launcher's default (16 x 128 x 128, 4
# warps) first, then the runners-up of the 2026-11-29 sweep and wider tiles of rows for prefill
GEMM_CONFIGS = [
    (16, 128, 128, 4, 2),
    (16, 64, 128, 4, 3),
    (16, 128, 128, 8, 2),
    (32, 128, 128, 4, 2),
    (64, 128, 128, 4, 2),
    (64, 128, 256, 8, 2),
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


def _dequant_point(w: dict[str, Any], bw: float) -> dict[str, Any]:
    """kernels/w4a16_dequant over the whole weight into one bf16 buffer, per launch config."""
    from kernels.w4a16 import PACK
    from kernels.w4a16_dequant import w4a16_dequantize
    from services.executor.models.linear import _time_us

    n, k = w["qweight"].shape[0], w["qweight"].shape[1] * PACK
    out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    moved = _bytes(w, out)  # packed words, scales, zero points (and perm) read; out written
    by_cfg: dict[tuple[int, int, int], float] = {}
    for bn, bwords, warps in DEQUANT_CONFIGS:
        run = partial(
            w4a16_dequantize, **w, dtype=torch.bfloat16, out=out,
            block_n=bn, block_w=bwords, num_warps=warps,
        )  # fmt: skip
        by_cfg[(bn, bwords, warps)] = _time_us(run)
    best = min(by_cfg, key=by_cfg.__getitem__)
    # the launcher's own choice (it differs with an act-order perm), not a grid entry
    default_us = _time_us(partial(w4a16_dequantize, **w, dtype=torch.bfloat16, out=out))
    return {
        "default_us": default_us,
        "default_GBps": moved / default_us / 1e3,
        "default_of_copy": moved / default_us / 1e6 / (bw / 1e12),
        "best_us": by_cfg[best],
        "best_of_copy": moved / by_cfg[best] / 1e6 / (bw / 1e12),
        "best_config": {"block_n": best[0], "block_w": best[1], "num_warps": best[2]},
    }


def _prefill_rows(
    n: int, k: int, bw: float, gen: torch.Generator, act_order: bool
) -> dict[str, Any]:
    from kernels.w4a16_gemm import w4a16_gemm
    from kernels.w4a16_matmul import w4a16_matmul
    from services.executor.models.linear import _time_us

    dense = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).bfloat16()
    w = _weights(n, k, gen, act_order)
    result: dict[str, Any] = {"dequant": _dequant_point(w, bw)}
    rows: dict[str, Any] = {}
    for m in PREFILL_ROWS:
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
                result.setdefault("skipped", []).append(f"{(bm, bn, bk, warps, stages)}: {e}")
        expand_us = _time_us(partial(w4a16_matmul, x, **w, gemm_max_m=0), reps=5)
        rows[str(m)] = {
            "gemm_us": best[0],
            "gemm_config": best[1],
            "dequant_cublas_us": expand_us,
            "bf16_cublas_us": bf16_us,
            "gemm_over_bf16_time": best[0] / bf16_us,
            "dequant_cublas_over_bf16_time": expand_us / bf16_us,
        }
    result["rows"] = rows
    result["crossover_m"] = crossover(rows)
    return result


def crossover(rows: dict[str, Any]) -> int | None:
    """The smallest measured row count from which dequantise + cuBLAS beats the GEMM at it
    and every larger count (None: the GEMM wins the largest)."""
    found = None
    for m in sorted(rows, key=int, reverse=True):
        if rows[m]["dequant_cublas_us"] >= rows[m]["gemm_us"]:
            break
        found = int(m)
    return found


def _prefill_section(bw: float, gen: torch.Generator) -> dict[str, Any]:
    shapes = [(name, n, k, False) for name, (n, k) in LLAMA_8B.items()]
    shapes.append(("down_act_order", *LLAMA_8B["down"], True))
    projections: dict[str, Any] = {}
    for name, n, k, act_order in shapes:
        projections[name] = _prefill_rows(n, k, bw, gen, act_order)
        torch.cuda.empty_cache()
    ms = [r["crossover_m"] for r in projections.values()]
    # where one projection never crosses over, the GEMM keeps every measured row count
    worst = PREFILL_ROWS[-1] + 1 if None in ms else max(m for m in ms if m is not None)
    return {"projections": projections, "gemm_max_m": worst - 1}


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
        "prefill": _prefill_section(bw, gen),
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
    prefill = result.get("prefill", {})
    for name, p in prefill.get("projections", {}).items():
        d = p["dequant"]
        rows.append(
            (
                f"int4 dequantise {name}",
                f"{d['default_us']:.0f} us, {d['default_GBps']:.0f} GB/s = "
                f"{100 * d['default_of_copy']:.0f}% of copy bandwidth (best tile "
                f"{100 * d['best_of_copy']:.0f}%)",
            )
        )
        for m, r in p["rows"].items():
            rows.append(
                (
                    f"int4 prefill {name}, {m} rows",
                    f"GEMM {r['gemm_us']:.0f} us, dequantise + cuBLAS "
                    f"{r['dequant_cublas_us']:.0f} us, bf16 cuBLAS {r['bf16_cublas_us']:.0f} us",
                )
            )
        rows.append(
            (f"int4 prefill {name}: dequantise + cuBLAS wins from rows", str(p["crossover_m"]))
        )
    if "gemm_max_m" in prefill:
        rows.append(
            ("int4 prefill: GEMM_MAX_M to set (largest crossover - 1)", str(prefill["gemm_max_m"]))
        )
    return rows
