"""Decode's skinny matmul over GGUF blocks: out[m, n] = x[m, :] . W[n, :], W dequantised on the fly.

Batch-1 decode is bound by reading the weights, so the weight must be read as the blocks it
is stored in (Q4_K: 4.5 bits a weight, not 16) and expanded only in registers. As
kernels/gemv.py does for bf16, each program streams BLOCK_N rows of blocks once, decodes a
tile [BLOCK_N, GROUPS, GROUP] at a time (kernels/gguf_blocks.py) and keeps the M <= MAX_M
partial sums per row in registers, so one launch does the whole product.

Grid: (cdiv(N, BLOCK_N),); program p computes out[:, p * BLOCK_N : (p + 1) * BLOCK_N] for every
row of x, accumulating in fp32, rounding once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_launch, check_tensor
from kernels.gemv import MAX_M, store_rows
from kernels.gguf_blocks import check_blocks, decode_groups, dequantize_ref
from kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    NUM_GROUPS,
    stride_xm,
    stride_wn,
    stride_om,
    M: tl.constexpr,
    QTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64) * stride_wn
    offs_e = tl.arange(0, GROUP)[None, :]
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g0 in range(0, NUM_GROUPS, GROUPS):
        gi = g0 + tl.arange(0, GROUPS)
        g_mask = gi < NUM_GROUPS
        w = decode_groups(w_ptr, rows, gi, n_mask[:, None] & g_mask[None, :], QTYPE, GROUP)
        x_at = gi[:, None] * GROUP + offs_e  # [GROUPS, GROUP] columns of x
        x_mask = g_mask[:, None]
        x0 = tl.load(x_ptr + x_at, mask=x_mask, other=0.0).to(tl.float32)
        acc0 += tl.sum(tl.sum(w * x0[None, :, :], axis=2), axis=1)
        if M > 1:
            x1 = tl.load(x_ptr + stride_xm + x_at, mask=x_mask, other=0.0).to(tl.float32)
            acc1 += tl.sum(tl.sum(w * x1[None, :, :], axis=2), axis=1)
        if M > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + x_at, mask=x_mask, other=0.0).to(tl.float32)
            acc2 += tl.sum(tl.sum(w * x2[None, :, :], axis=2), axis=1)
        if M > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + x_at, mask=x_mask, other=0.0).to(tl.float32)
            acc3 += tl.sum(tl.sum(w * x3[None, :, :], axis=2), axis=1)
    store_rows(out_ptr, stride_om, offs_n, n_mask, acc0, acc1, acc2, acc3, M)


def gguf_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    *,
    qtype: str,
    out: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ W.T for at most MAX_M rows of x, W given as GGUF blocks of `qtype`; returns out.

    x: [m, k] (any row stride, m <= MAX_M), a float dtype; blocks: uint8 [n, row bytes]
    (kernels/gguf_blocks.py). out (optional, written): [m, n] of x's dtype, any row stride.
    block_n, block_k: rows per program and weights per step (powers of two, block_k at least
    the type's scale group).
    """
    op = "gguf_gemv"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    lay = check_blocks(op, blocks, qtype, k, device=x.device)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {size}")
    if block_k < lay.group:
        raise ValueError(f"{op}: block_k must be at least {lay.group} for {qtype}, got {block_k}")
    check_launch(op, num_warps, num_stages)
    if n == 0:
        return out
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        blocks,
        out,
        n,
        k // lay.group,
        x.stride(0),
        blocks.stride(0),
        out.stride(0),
        M=m,
        QTYPE=lay.type_id,
        GROUP=lay.group,
        BLOCK_N=block_n,
        GROUPS=block_k // lay.group,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out


def gguf_gemv_ref(x: torch.Tensor, blocks: torch.Tensor, *, qtype: str) -> torch.Tensor:
    """The torch twin of `gguf_gemv` (and of gguf_matmul): the weights dequantised in fp32,
    fp32 products and sums, rounded once to x's dtype."""
    return (x.float() @ dequantize_ref(blocks, qtype).T).to(x.dtype)
