"""GGUF blocks on the GPU (kernels/gguf_*): the decode GEMV's bandwidth and where prefill should
leave the dequantising GEMM for expand-then-cuBLAS, at Llama-3.1-8B's projection shapes.

- gemv: per type and shape, rows 1..MAX_M, the best of a small grid of launch configurations;
  bytes read (blocks + x) / time against the copy bandwidth, beside bf16's own skinny matmul
  (kernels/gemv, cuBLAS) on the same shape. `layer_*` sums one decoder layer's projections at
  one row: the batch-1 decode speed the projections alone allow, against their roofline.
- matmul: Q4_K at the MLP's gate_up shape over row counts from a decode batch to a prefill
  chunk: kernels/gguf_gemm against expanding the weight and cuBLAS (gguf_matmul's two paths
  past MAX_M) and against bf16 cuBLAS; `crossover_m` is the first row count where expanding
  wins, the figure kernels/gguf_matmul.GEMM_MAX_M should follow.
Every timing replays a CUDA graph (gpu/mla_kernel.graph_seconds), so launch overhead is out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.gemv import MAX_M, gemv
from kernels.gguf_blocks import LAYOUTS, random_blocks, row_bytes
from kernels.gguf_gemm import gguf_gemm
from kernels.gguf_gemv import gguf_gemv
from kernels.gguf_matmul import gguf_matmul
from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.mla_kernel import graph_seconds

LAYERS = 32  # Llama-3.1-8B
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
QTYPES = ("Q4_K", "Q6_K", "Q8_0")
# (block_n, block_k, num_warps, num_stages) tried at one row; the best also runs 2..MAX_M
CONFIGS = [(8, 512, 4, 3), (16, 256, 4, 3), (4, 512, 4, 4), (4, 1024, 4, 3), (2, 1024, 4, 4)]
MATMUL_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def gguf_kernel_section() -> dict[str, Any]:
    bw = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    gemv_rows: dict[str, Any] = {}
    for qtype in QTYPES:
        for name, (n, k) in SHAPES.items():
            gemv_rows[f"{qtype} {name}"] = _gemv_point(qtype, n, k, bw, gen)
    for name, (n, k) in SHAPES.items():
        gemv_rows[f"bf16 {name}"] = _bf16_point(n, k, bw, gen)
    layer: dict[str, Any] = {}
    for kind in (*QTYPES, "bf16"):
        seconds = sum(gemv_rows[f"{kind} {name}"]["m1_us"] for name in SHAPES) / 1e6
        read = sum(gemv_rows[f"{kind} {name}"]["bytes_m1"] for name in SHAPES)
        layer[kind] = {
            "layer_us": seconds * 1e6,
            "projections_tok_s": 1 / (LAYERS * seconds),
            "projections_roofline_tok_s": bw / (LAYERS * read),
        }
    torch.cuda.empty_cache()
    return {
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bw / 1e12,
        "gemv": gemv_rows,
        "layer": layer,
        "matmul": _matmul_points(gen),
    }


def _gemv_point(qtype: str, n: int, k: int, bw: float, gen: torch.Generator) -> dict[str, Any]:
    blocks = random_blocks(n, k, qtype, gen, "cuda")
    x = torch.randn(MAX_M, k, generator=gen).to("cuda", torch.bfloat16)

    def timed(m: int, cfg: tuple[int, int, int, int]) -> float:
        bn, bk, warps, stages = cfg
        if bk < LAYOUTS[qtype].group:
            return float("inf")
        out = torch.empty(m, n, dtype=x.dtype, device="cuda")
        kw = {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}
        return graph_seconds(lambda: gguf_gemv(x[:m], blocks, qtype=qtype, out=out, **kw))

    by_cfg = {cfg: timed(1, cfg) for cfg in CONFIGS}
    best = min(by_cfg, key=by_cfg.__getitem__)
    point: dict[str, Any] = {"best_config": list(best), "bytes_m1": n * row_bytes(qtype, k) + 2 * k}
    for m in range(1, MAX_M + 1):
        seconds = by_cfg[best] if m == 1 else timed(m, best)
        read = n * row_bytes(qtype, k) + 2 * m * k
        point[f"m{m}_us"] = seconds * 1e6
        point[f"m{m}_of_copy"] = read / seconds / bw
    return point


def _bf16_point(n: int, k: int, bw: float, gen: torch.Generator) -> dict[str, Any]:
    """One row through kernels/gemv and through cuBLAS; the faster counts, as Linear picks."""
    w = torch.randn(n, k, generator=gen).to("cuda", torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to("cuda", torch.bfloat16)
    seconds = min(graph_seconds(lambda: gemv(x, w)), graph_seconds(lambda: F.linear(x, w)))
    read = 2 * n * k + 2 * k
    return {"bytes_m1": read, "m1_us": seconds * 1e6, "m1_of_copy": read / seconds / bw}


def _matmul_points(gen: torch.Generator) -> dict[str, Any]:
    n, k = SHAPES["gate_up"]
    blocks = random_blocks(n, k, "Q4_K", gen, "cuda")
    w = torch.randn(n, k, generator=gen).to("cuda", torch.bfloat16)
    rows: dict[str, Any] = {}
    crossover = None
    for m in MATMUL_ROWS:
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        fused = graph_seconds(lambda: gguf_gemm(x, blocks, qtype="Q4_K"), reps=5)  # noqa: B023
        expand = graph_seconds(
            lambda: gguf_matmul(x, blocks, qtype="Q4_K", gemm_max_m=0),  # noqa: B023
            reps=5,
        )
        dense = graph_seconds(lambda: F.linear(x, w), reps=5)  # noqa: B023
        if crossover is None and expand < fused:
            crossover = m
        rows[str(m)] = {
            "gemm_us": fused * 1e6,
            "expand_cublas_us": expand * 1e6,
            "bf16_cublas_us": dense * 1e6,
            "gemm_TFLOPs": 2 * m * n * k / fused / 1e12,
        }
    return {"shape": [n, k], "rows": rows, "crossover_m": crossover}


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """gpu_bench's summary lines for this section."""
    rows = []
    for kind, r in result.get("layer", {}).items():
        rows.append(
            (
                f"GGUF kernels: Llama-3.1-8B projections, batch 1, {kind}",
                f"{r['projections_tok_s']:.0f} tok/s = "
                f"{100 * r['projections_tok_s'] / r['projections_roofline_tok_s']:.0f}% of "
                f"roofline {r['projections_roofline_tok_s']:.0f}",
            )
        )
    matmul = result.get("matmul", {})
    if matmul:
        rows.append(
            (
                "GGUF Q4_K: expand + cuBLAS beats the dequantising GEMM from rows",
                str(matmul.get("crossover_m")),
            )
        )
    return rows
