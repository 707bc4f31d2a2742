"""fp8 weights (w8a16) on the tensor cores for decode batches past the GEMV's rows: out = x @
(W * scale).T for up to a few dozen rows of x, W float8_e4m3fn, x in 16 bits.

Decode batches of 5 to 32 requests need to read W once. Past the GEMV's rows, the fp8 path
quantized x per token and ran torch._scaled_mm (per-channel scales) or the block-scale GEMM
(kernels/fp8_block_gemm.py): on an H200 a batch of 8 decoded slower than bf16 (Llama-3.1-8B
shapes: fp8 per channel 0.91x, blocks 0.80x), both built for many rows. Here, as in
kernels/w4a16_gemm.py, W is the MMA's M side and x its N side (out.T = W @ x.T), so 16 rows
of x cost the tensor cores what one does; each weight is widened to x's dtype in registers
(exact: every e4m3 value is a bf16 and an fp16) and x is used as it is, not quantized. A
per-row scale is applied once to the sums; block scales (128 x 128) once a step, a step
lying in one block of columns. K is split across programs as kernels/split_k.py describes.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N) * SPLIT).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_fp8_scale,
    check_launch,
    check_tensor,
    check_tile,
    dot_precision,
)
from kernels.fp8_gemv import fp8_gemv_ref
from kernels.fp8_weights import BLOCK, FP8
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.split_k import plan, program_tile, store_tile, sum_splits, workspace

# Rows of x; past them the activations are quantized for the fp8 GEMMs. On an H200
# (Llama-3.1-8B's four projections, cold weights, µs): 8 rows 105.7 against 143.3 for
# quantize + _scaled_mm (bf16 134.6), 16 rows 106.6 against 135.1; 32 rows 128.6 against
# 135.8 with one tile of 32 rows (179.8 with two of 16).
GEMM_MAX_M = 32


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # fp8 [N, K]
    s_ptr,  # fp32 [N, 1] or [ceil(N / 128), ceil(K / 128)] (SCALE_BLOCK)
    out_ptr,  # [M, N] (SPLIT == 1) or fp32 [SPLIT, M, N], the partial sums
    M,
    N,
    K,
    STEPS_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,  # between splits' partial sums
    SPLIT,
    SCALE_BLOCK: tl.constexpr,  # 0: a scale per row; else the blocks' side
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    split, offs_n, offs_m, n_mask, m_mask, rows = program_tile(M, N, SPLIT, BLOCK_M, BLOCK_N)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    x_rows = offs_m.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = split * STEPS_PER_SPLIT * BLOCK_K
    k_end = tl.minimum(k_start + STEPS_PER_SPLIT * BLOCK_K, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(
            w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=k_mask[None, :], other=0.0
        ).to(dtype)
        xt = tl.load(
            x_ptr + x_rows + offs_k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0
        )
        if SCALE_BLOCK > 0:  # the step lies in one block of columns: scale its sums
            s = tl.load(s_ptr + (rows // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK)
            acc += s[:, None] * tl.dot(w, xt, input_precision=PRECISION)
        else:
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    if SCALE_BLOCK == 0:
        acc *= tl.load(s_ptr + rows * stride_sn)[:, None]
    store_tile(out_ptr, acc, split, offs_n, offs_m, n_mask, m_mask, stride_om, stride_os)


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_scales: bool = False,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 128,
    split: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ (weight * scale).T; returns out.

    x: [m, k] (any row stride), fp32/fp16/bf16; weight: [n, k] float8_e4m3fn (any row
    stride); scale fp32: [n, 1] per row, or with block_scales [ceil(n/128), ceil(k/128)] per
    128x128 block. out (optional, written): [m, n] of x's dtype, contiguous rows of any
    stride. block_m: the tile of x's rows (None: 16 up to 16 rows, else 32); block_n: the
    tile of W's rows (both powers of two of at least 16); block_k: columns a step (a power of
    two of at least 16; with block_scales at most 128). split: programs splitting K (a power
    of two; None: kernels/split_k's `default_split`).
    """
    op = "fp8_gemm"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if block_m is None:  # one tile of x's rows: every tile widens the weight again
        block_m = 16 if m <= 16 else 32
    check_tensor(
        op, "weight", weight, shape=(None, k), dims="[n, k]", dtypes=(FP8,), device=x.device
    )
    n = weight.shape[0]
    check_fp8_scale(op, scale, n, k, block_scales, x.device)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check_tile(op, name, size)
    if block_scales and block_k > BLOCK:
        raise ValueError(f"{op}: block_k must be at most {BLOCK} with block scales, got {block_k}")
    check_launch(op, num_warps, num_stages)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    split, per_split = plan(op, triton.cdiv(k, block_k), split)
    target = workspace(out, split)
    pdl = pdl_launch(x.device)
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n) * split)](
        x,
        weight,
        scale,
        target,
        m,
        n,
        k,
        per_split,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        target.stride(-2),
        target.stride(0) if split > 1 else 0,
        split,
        SCALE_BLOCK=BLOCK if block_scales else 0,
        PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    sum_splits(target, out, pdl)
    return out


# The torch twin: the same product as the GEMV's, x times the dequantized weight in fp32, one
# rounding at the end.
fp8_gemm_ref = fp8_gemv_ref
