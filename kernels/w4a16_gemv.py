"""Dequantising skinny matmul for decode: out = x @ w.T for a handful of rows of x, w int4 in
the layout of kernels/w4a16.py.

Decode reads every weight once per token, so the kernel is built around reading the packed
words once and doing as little arithmetic per weight as possible (at int4, the H100's integer
and fp32 throughput, not its bandwidth, is the next limit). A program owns BLOCK_N output rows
and walks K in blocks of whole groups, viewing each block as [BLOCK_N, groups, words, 8]:
the 8 nibbles of a word are split with one shift and mask each, and a group's zero point and
scale are applied once per group, not per weight:

    sum_k x_k (q_k - z) s  =  s * (sum_k x_k q_k  -  z * sum_k x_k)

so each weight costs a shift, a mask, a conversion and one fused multiply-add. All M (at most
MAX_M) partial sums stay in registers, as in kernels/gemv.py.

Grid: (cdiv(N, BLOCK_N),); accumulation in fp32, one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launch, check_tensor
from kernels.gemv import MAX_M, store_rows
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16 import check_w4, columns_of_x


@triton.jit
def _row_dot(x_row_ptr, src, x_mask, qf, s, z):
    """One row of x against the [BLOCK_N, NG, W, 8] dequantisation-free tile: [BLOCK_N]."""
    x = tl.load(x_row_ptr + src, mask=x_mask, other=0.0).to(tl.float32)  # [NG, W, 8]
    xq = tl.sum(tl.sum(qf * x[None, :, :, :], axis=3), axis=2)  # [BLOCK_N, NG]
    xs = tl.sum(tl.sum(x, axis=2), axis=1)  # [NG]
    return tl.sum(s * (xq - z * xs[None, :]), axis=1)


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
    GROUPS_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    WORDS: tl.constexpr = GROUP // 8  # words per group
    BLOCK_K: tl.constexpr = GROUPS_PER_BLOCK * GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_g = tl.arange(0, GROUPS_PER_BLOCK)
    # word index within a block, and the k of each nibble: [NG, W] and [NG, W, 8]
    word = offs_g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    nib = tl.arange(0, 8)
    k_in_block = word[:, :, None] * 8 + nib[None, None, :]
    shifts = (nib * 4)[None, None, None, :]
    num_words = K // 8
    num_groups = tl.cdiv(K, GROUP)
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        words = k0 // 8 + word
        q_mask = n_mask[:, None, None] & (words < num_words)[None, :, :]
        q = tl.load(
            qw_ptr + rows[:, None, None] * stride_qn + words[None, :, :], mask=q_mask, other=0
        )  # [BLOCK_N, NG, W]
        qf = ((q[:, :, :, None] >> shifts) & 0xF).to(tl.float32)  # [BLOCK_N, NG, W, 8]
        groups = k0 // GROUP + offs_g
        g_mask = n_mask[:, None] & (groups < num_groups)[None, :]
        s = tl.load(s_ptr + rows[:, None] * stride_sn + groups[None, :], mask=g_mask, other=0.0)
        z = tl.load(z_ptr + rows[:, None] * stride_zn + groups[None, :], mask=g_mask, other=0)
        s = s.to(tl.float32)
        z = z.to(tl.float32)
        ks = k0 + k_in_block
        k_mask = ks < K
        src, x_mask = columns_of_x(perm_ptr, ks, k_mask, HAS_PERM)
        acc0 += _row_dot(x_ptr, src, x_mask, qf, s, z)
        if M > 1:
            acc1 += _row_dot(x_ptr + stride_xm, src, x_mask, qf, s, z)
        if M > 2:
            acc2 += _row_dot(x_ptr + 2 * stride_xm, src, x_mask, qf, s, z)
        if M > 3:
            acc3 += _row_dot(x_ptr + 3 * stride_xm, src, x_mask, qf, s, z)
    store_rows(out_ptr, stride_om, offs_n, n_mask, acc0, acc1, acc2, acc3, M)


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 16,
    groups_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ w.T for at most MAX_M rows of x, w in the int4 layout of kernels/w4a16.py; returns out.

    x: [m, k_in] (any row stride, m <= MAX_M), fp32/fp16/bf16. qweight, scales, zeros, perm:
    the layout (contiguous last dimensions, any row strides). out (optional, written): [m, n]
    of x's dtype, contiguous rows of any stride. block_n: output rows per program;
    groups_per_block: groups of K per step (both powers of two; by default 256 columns a
    step, 128 bytes of each weight row).
    """
    op = "w4a16_gemv"
    m, n, k = check_w4(op, x, qweight, scales, zeros, group_size, perm)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    if groups_per_block is None:
        groups_per_block = max(1, 256 // group_size)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    for name, blk in (("block_n", block_n), ("groups_per_block", groups_per_block)):
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {blk}")
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
        GROUPS_PER_BLOCK=groups_per_block,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out
