"""Skinny matmul over fp8 weights for decode: out[m, n] = x[m, :] . (q[n, :] * s) for at most
MAX_M rows, x in 16/32-bit floats, the weight read as 8-bit floats.

Batch-1 decode reads every weight once per token, so halving the bytes read is the speedup:
this runs kernels/gemv.py's kernel (one program per BLOCK_N output rows streaming K in
BLOCK_K chunks, all M partial sums in registers, fp32 accumulation) in its variant that loads
the weight as fp8 and widens it in registers. Scales: per output row ([n, 1]: applied once to
the finished sums) or per 128x128 block ([ceil(n/128), ceil(k/128)]: each tile is scaled as
it is widened, so a chunk of BLOCK_K columns, a multiple of 128, takes BLOCK_K / 128 scales
per row).
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_fp8_scale, check_tensor
from kernels.fp8_gemv_packed import PACKED_K, launch_packed, packed_fits
from kernels.fp8_weights import BLOCK, FP8, dequantize
from kernels.gemv import checked_out, launch


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_scales: bool = False,
    out: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
    packed: bool = False,
) -> torch.Tensor:
    """x @ (weight * scale).T for at most MAX_M rows; returns out.

    x: [m, k] float (any row stride, m <= MAX_M); weight: [n, k] float8_e4m3fn (any row
    stride); scale fp32: [n, 1] per row, or with block_scales [ceil(n/128), ceil(k/128)]
    per 128x128 block. out (optional, written): [m, n] in x's dtype.
    block_n, block_k: output rows per program and weight columns per step (powers of two;
    with block_scales block_k is a multiple of 128). packed: through the packed kernel where
    it fits (then num_warps must be block_k / 512, the warps its step is).
    """
    op = "fp8_gemv"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    out = checked_out(op, x, weight, (FP8,), out)
    n, k = weight.shape
    check_fp8_scale(op, scale, n, k, block_scales, x.device)
    if packed and num_warps * PACKED_K != block_k:
        raise ValueError(
            f"{op}: a packed step of block_k={block_k} columns is {block_k // PACKED_K} warps "
            f"({PACKED_K} columns a warp), got num_warps={num_warps}"
        )
    scale_block = BLOCK if block_scales else 0
    if packed and packed_fits(x, weight, block_n, block_k):
        launch_packed(
            x, weight, scale, out, scale_block=scale_block, block_n=block_n, block_k=block_k,
            num_stages=num_stages,
        )  # fmt: skip
        return out
    launch(
        x, weight, scale, out, block_n, block_k, num_warps, num_stages,
        scale_block=scale_block, op=op,
    )  # fmt: skip
    return out


def fp8_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, block_scales: bool = False
) -> torch.Tensor:
    """The torch twin of `fp8_gemv`: the weight dequantized in fp32, one rounding at the end."""
    w = dequantize(weight, scale, BLOCK if block_scales else 0)
    return (x.float() @ w.T).to(x.dtype)
