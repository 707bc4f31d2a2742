"""Skinny matmul for decode: out[m, n] = x[m, :] . weight[n, :] for a handful of rows m.

A decode step of a small batch is a matrix-vector product per projection, bound by reading
the weight once. cuBLAS splits K for some of these shapes and adds a reduction kernel; this
kernel reads each weight row exactly once, streams it in BLOCK_K chunks and keeps all M
partial sums per output row in registers, so one launch does the whole product.

Grid: (cdiv(N, BLOCK_N),); program p computes out[:, p * BLOCK_N : (p + 1) * BLOCK_N] for
every one of the M (at most MAX_M) rows of x, accumulating in fp32, rounding once.
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
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    M: tl.constexpr,
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
) -> torch.Tensor:
    """x @ weight.T for at most MAX_M rows; returns out.

    x: [m, k] (any row stride, m <= MAX_M); weight: [n, k] (any row stride), x's dtype.
    out (optional, written): [m, n] contiguous rows of any stride, x's dtype.
    block_n, block_k: output rows per program and weight columns per step (powers of two).
    """
    op = "gemv"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    check_tensor(
        op, "weight", weight, shape=(None, k), dims="[n, k]", dtypes=(x.dtype,), device=x.device
    )
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    for name, blk in (("block_n", block_n), ("block_k", block_k)):
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {blk}")
    if n == 0:
        return out
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        out,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        M=m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch twin of `gemv`: fp32 products and sums, rounded once to x's dtype."""
    return (x.float() @ weight.float().T).to(x.dtype)
