"""GGUF blocks on the GPU (kernels/gguf_*): the decode GEMV's bandwidth and what rows past it
cost (expand-then-cuBLAS), at Llama-3.1-8B's projection shapes.

- gemv: per type and shape, rows 1..MAX_M: the launch configurations choose_gemv times for
  the type (quant/gguf_linear.GGUF_CANDIDATES), every one at one row (m1_us_by_config), at
  more rows the fastest of one row's best and the narrowest; bytes read (blocks + x) / time
  against the copy bandwidth, beside bf16's own skinny matmul (kernels/gemv, cuBLAS) on the
  same shape.
  `layer_*` sums one decoder layer's projections at one row: the batch-1 decode speed the
  projections alone allow, against their roofline.
- matmul: Q4_K at the MLP's gate_up shape over row counts from a decode batch to a prefill
  chunk: gguf_matmul past MAX_M (the weight expanded in slices, each through cuBLAS) against
  bf16 cuBLAS on the same shape.
Every timing replays a CUDA graph (gpu/mla_kernel.graph_seconds), so launch overhead is out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.gemv import MAX_M, gemv
from kernels.gguf_blocks import random_blocks, row_bytes
from kernels.gguf_gemv import gguf_gemv
from kernels.gguf_matmul import gguf_matmul
from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.mla_kernel import graph_seconds
from services.executor.models.linear import GemvConfig
from services.executor.quant.gguf_linear import GGUF_CANDIDATES

LAYERS = 32  # Llama-3.1-8B
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
QTYPES = ("Q4_K", "Q6_K", "Q8_0")
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

    def timed(m: int, cfg: GemvConfig) -> float:
        out = torch.empty(m, n, dtype=x.dtype, device="cuda")
        kw = {"block_n": cfg.block_n, "block_k": cfg.block_k, "num_warps": cfg.num_warps}
        return graph_seconds(
            lambda: gguf_gemv(x[:m], blocks, qtype=qtype, out=out, num_stages=cfg.num_stages, **kw)
        )

    # every candidate at one row; more rows take the best of those and the one of fewest
    # rows a program (the most registers left for the rows of x), as compiles are the cost
    configs = GGUF_CANDIDATES[qtype]
    at_m1 = {cfg: timed(1, cfg) for cfg in configs}
    best_m1 = min(at_m1, key=at_m1.__getitem__)
    narrow = min(configs, key=lambda c: (c.block_n, -c.block_k))
    point: dict[str, Any] = {
        "bytes_m1": n * row_bytes(qtype, k) + 2 * k,
        "m1_us_by_config": {_label(c): t * 1e6 for c, t in at_m1.items()},
    }
    for m in range(1, MAX_M + 1):
        by_cfg = at_m1 if m == 1 else {c: timed(m, c) for c in {best_m1, narrow}}
        best = min(by_cfg, key=by_cfg.__getitem__)
        read = n * row_bytes(qtype, k) + 2 * m * k
        point[f"m{m}_config"] = _label(best)
        point[f"m{m}_us"] = by_cfg[best] * 1e6
        point[f"m{m}_of_copy"] = read / by_cfg[best] / bw
    return point


def _label(cfg: GemvConfig) -> str:
    return f"{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}w"


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
    for m in MATMUL_ROWS:
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        expand = graph_seconds(lambda: gguf_matmul(x, blocks, qtype="Q4_K"), reps=5)  # noqa: B023
        dense = graph_seconds(lambda: F.linear(x, w), reps=5)  # noqa: B023
        rows[str(m)] = {
            "expand_cublas_us": expand * 1e6,
            "bf16_cublas_us": dense * 1e6,
            "expand_over_bf16_time": expand / dense,
        }
    return {"shape": [n, k], "rows": rows}


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
    for m, r in result.get("matmul", {}).get("rows", {}).items():
        rows.append(
            (
                f"GGUF Q4_K gate_up, {m} rows: expand + cuBLAS",
                f"{r['expand_cublas_us']:.1f} us, {r['expand_over_bf16_time']:.2f}x bf16's time",
            )
        )
    return rows
