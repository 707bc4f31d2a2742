"""Skinny matmul for decode: out[m, n] = x[m, :] . weight[n, :] for a handful of rows m.

A decode step of a small batch is a matrix-vector product per projection, bound by reading
the weight once. cuBLAS splits K for some of these shapes and adds a reduction kernel; this
kernel reads each weight row exactly once, streams it in BLOCK_K chunks and keeps all M
partial sums per output row in registers, so one launch does the whole product.

Grid: (cdiv(N, BLOCK_N),); program p computes out[:, p * BLOCK_N : (p + 1) * BLOCK_N] for
every one of the M (at most MAX_M) rows of x, accumulating in fp32, rounding once.

The same kernel reads fp8 weights with their scales for kernels/fp8_gemv.py (`SCALES`): the
code it adds is compiled only into that variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.pdl import pdl_launch, pdl_prologue

MAX_M = 4  # rows of x; past that a tensor-core GEMM reads the weight just as well


@triton.jit
def store_rows(out_ptr, stride_om, offs_n, n_mask, acc0, acc1, acc2, acc3, M: tl.constexpr):
    """Round the sums of the M (<= MAX_M) rows, each [BLOCK_N], to out's dtype and store
    them at out[m, offs_n] (rows stride_om apart); accumulators past M are not read."""
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_n, acc0.to(dtype), mask=n_mask)
    if M > 1:
        tl.store(out_ptr + stride_om + offs_n, acc1.to(dtype), mask=n_mask)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + offs_n, acc2.to(dtype), mask=n_mask)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + offs_n, acc3.to(dtype), mask=n_mask)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    M: tl.constexpr,
    SCALES: tl.constexpr,  # False: the weight as it is; True: fp8, scaled (s_ptr)
    SCALE_BLOCK: tl.constexpr,  # with SCALES: 0 a scale per row, else the blocks' side
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None] * stride_wn
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(
            w_ptr + rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        if SCALES and SCALE_BLOCK > 0:
            GROUPS: tl.constexpr = BLOCK_K // SCALE_BLOCK
            kb = k0 // SCALE_BLOCK + tl.arange(0, GROUPS)
            s = tl.load(
                s_ptr + (offs_n // SCALE_BLOCK).to(tl.int64)[:, None] * stride_sn + kb[None, :],
                mask=n_mask[:, None] & (kb * SCALE_BLOCK < K)[None, :],
                other=0.0,
            )  # [BLOCK_N, GROUPS]
            w = tl.reshape(
                tl.reshape(w, [BLOCK_N, GROUPS, SCALE_BLOCK]) * s[:, :, None],
                [BLOCK_N, BLOCK_K],
            )
        x0 = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], axis=1)
        if M > 1:
            x1 = tl.load(x_ptr + stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], axis=1)
        if M > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc2 += tl.sum(w * x2[None, :], axis=1)
        if M > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc3 += tl.sum(w * x3[None, :], axis=1)
    if SCALES and SCALE_BLOCK == 0:
        row_scale = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn, mask=n_mask, other=0.0)
        acc0 *= row_scale
        acc1 *= row_scale
        acc2 *= row_scale
        acc3 *= row_scale
    store_rows(out_ptr, stride_om, offs_n, n_mask, acc0, acc1, acc2, acc3, M)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight.T for at most MAX_M rows; returns out.

    x: [m, k] (any row stride, m <= MAX_M); weight: [n, k] (any row stride), x's dtype.
    out (optional, written): [m, n] contiguous rows of any stride, of out_dtype: x's dtype
    (None), or float32 for the fp32 sums unrounded (DeepSeek's router logits, which its
    checkpoints compute as F.linear(x.float(), w.float()): the same exact products, summed
    in fp32, without widening copies of x and w).
    block_n, block_k: output rows per program and weight columns per step (powers of two).
    """
    op = "gemv"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"{op}: out_dtype must be x's dtype or float32, got {out_dtype}")
    out = checked_out(op, x, weight, (x.dtype,), out, out_dtype or x.dtype)
    launch(x, weight, None, out, block_n, block_k, num_warps, num_stages, op=op)
    return out


def checked_out(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_dtypes: tuple[torch.dtype, ...],
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`out` (allocated when None) after checking x's rows, the weight and out against x;
    out's dtype is out_dtype (None: x's)."""
    check_device(op, x)
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    check_tensor(
        op, "weight", weight, shape=(None, k), dims="[n, k]", dtypes=weight_dtypes,
        device=x.device,
    )  # fmt: skip
    n = weight.shape[0]
    dtype = out_dtype or x.dtype
    if out is None:
        out = torch.empty((m, n), dtype=dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(dtype,), device=x.device)
    return out


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    *,
    scale_block: int = 0,
    op: str,
) -> None:
    """The kernel over checked arguments, for `gemv` and kernels/fp8_gemv.py (scale: None,
    or fp8 weight scales per row, or per `scale_block`-square block)."""
    for name, blk in (("block_n", block_n), ("block_k", block_k)):
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {blk}")
    if scale_block and block_k % scale_block:
        raise ValueError(f"{op}: block_k must be a multiple of {scale_block} with block scales")
    n = weight.shape[0]
    if n == 0:
        return
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        weight if scale is None else scale,  # never read without scales
        out,
        n,
        weight.shape[1],
        x.stride(0),
        weight.stride(0),
        0 if scale is None else scale.stride(0),
        out.stride(0),
        M=x.shape[0],
        SCALES=scale is not None,
        SCALE_BLOCK=scale_block,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The torch twin of `gemv`: fp32 products and sums, rounded once to out_dtype (x's)."""
    return (x.float() @ weight.float().T).to(out_dtype or x.dtype)
