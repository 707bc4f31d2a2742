"""Dequantising skinny matmul for decode: out = x @ w.T for a handful of rows of x, w int4 in
the layout of kernels/w4a16.py.

Decode reads every weight once per token, so the kernel is built around reading the packed
words once, in tiles big enough to keep the memory system busy, and doing as little
arithmetic per weight as possible. A program owns BLOCK_N output rows and walks K a tile of
[BLOCK_N, BLOCK_W] words at a time (8 columns a word). Everything stays two-dimensional
(no reshapes of the tile, which cost shuffles in compiled Triton):
- nibble j of every word is taken with one shift and mask and turned into a float without a
  conversion instruction: OR-ing it into the mantissa of 2^23 gives the float 2^23 + q, and
  subtracting 2^23 + z (both exact in fp32) gives q - z in one instruction;
- it meets x's column 8w + j (x is a few KB: reloaded per j from L1) in one fused
  multiply-add into a per-word partial sum, one per row of x;
- a word's partial is scaled by its group's scale once, into a [BLOCK_N, BLOCK_W]
  accumulator that is reduced across words only after the loop.
So a weight costs five simple instructions for the first row of x and one FMA for each
further row.

Grid: (cdiv(N, BLOCK_N),); accumulation in fp32, one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launch, check_tensor
from kernels.gemv import MAX_M, store_rows
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16 import PACK, check_w4, columns_of_x, load_words


@triton.jit
def _x_at(x_row_ptr, src, x_mask):
    """x's columns `src` [BLOCK_N, BLOCK_W] (the same column down each row of the tile)."""
    return tl.load(x_row_ptr + src, mask=x_mask, other=0.0).to(tl.float32)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K_in]
    qw_ptr,  # int32 [N, K / 8]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G]
    perm_ptr,  # int32 [K] (HAS_PERM)
    out_ptr,  # [M, N]
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    M: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    offs_w = tl.arange(0, BLOCK_W)
    num_words = K // 8
    acc0 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, num_words, BLOCK_W):
        words = w0 + offs_w
        w_mask = words < num_words
        nw_mask = n_mask[:, None] & w_mask[None, :]
        q, s, z = load_words(
            qw_ptr, s_ptr, z_ptr, rows, words[None, :], nw_mask,
            stride_qn, stride_sn, stride_zn, GROUP,
        )  # fmt: skip
        q = q.to(tl.uint32, bitcast=True)  # logical shifts: no sign to extend
        bias = z + 8388608.0  # 2^23 + z, exact
        p0 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        p1 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        p2 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        p3 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(8):
            nib = ((q >> (4 * j)) & 0xF) | 0x4B000000  # the float 2^23 + q, as bits
            w = nib.to(tl.float32, bitcast=True) - bias  # q - z
            # addressed as the whole tile, so each thread loads the columns of its own
            # words in the tile's layout (a [BLOCK_W] vector would be loaded in another
            # layout and passed through shared memory, behind two barriers per nibble)
            cols = words[None, :] * 8 + j + 0 * rows
            src, x_mask = columns_of_x(perm_ptr, cols, nw_mask, HAS_PERM)
            p0 += w * _x_at(x_ptr, src, x_mask)
            if M > 1:
                p1 += w * _x_at(x_ptr + stride_xm, src, x_mask)
            if M > 2:
                p2 += w * _x_at(x_ptr + 2 * stride_xm, src, x_mask)
            if M > 3:
                p3 += w * _x_at(x_ptr + 3 * stride_xm, src, x_mask)
        acc0 += s * p0
        if M > 1:
            acc1 += s * p1
        if M > 2:
            acc2 += s * p2
        if M > 3:
            acc3 += s * p3
    store_rows(
        out_ptr,
        stride_om,
        offs_n,
        n_mask,
        tl.sum(acc0, axis=1),
        tl.sum(acc1, axis=1),
        tl.sum(acc2, axis=1),
        tl.sum(acc3, axis=1),
        M,
    )


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 1024,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ w.T for at most MAX_M rows of x, w in the int4 layout of kernels/w4a16.py; returns out.

    x: [m, k_in] (any row stride, m <= MAX_M), fp32/fp16/bf16. qweight, scales, zeros, perm:
    the layout (contiguous last dimensions, any row strides). out (optional, written): [m, n]
    of x's dtype, contiguous rows of any stride. block_n: output rows per program; block_k:
    weight columns per step (block_k / 8 words; both powers of two, block_k >= 8).
    """
    op = "w4a16_gemv"
    m, n, k = check_w4(op, x, qweight, scales, zeros, group_size, perm)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    for name, blk in (("block_n", block_n), ("block_k", block_k)):
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {blk}")
    if block_k < PACK:
        raise ValueError(f"{op}: block_k must be at least {PACK} (one word), got {block_k}")
    check_launch(op, num_warps, num_stages)
    if n == 0:
        return out
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        qweight,
        scales,
        zeros,
        qweight if perm is None else perm,  # never read without a perm
        out,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        M=m,
        HAS_PERM=perm is not None,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_W=block_k // PACK,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out
