"""Dequantising matmul for a few rows (decode batches past the GEMV's, short extends): out = x @
w.T, w int4 in the layout of kernels/w4a16.py.

Each program computes a BLOCK_M x BLOCK_N tile of out. Per BLOCK_K step it loads x's tile
(through the act-order perm when there is one) and the [BLOCK_N, BLOCK_K / 8] packed words
of its weight rows, each word once with their scales and zero points, expands them in
registers (kernels/w4a16.dequantize_words) to x's dtype and feeds the tensor cores. (It
addressed each word once per nibble before, [BLOCK_N, BLOCK_K] scalar loads served by L1:
at 8 rows of x and Llama-3.1-8B's qkv it took 324 µs on an H200, against 35 for dequantising
the weight and cuBLAS.)

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), M fastest, so the programs that share a weight
tile run together and read it from L2. Accumulation in fp32, one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launch, check_tensor, check_tile, dot_precision
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16 import check_w4, columns_of_x, dequantize_words, load_words


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K_in]
    qw_ptr,  # int32 [N, K / 8]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G]
    perm_ptr,  # int32 [K] (HAS_PERM)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    HAS_PERM: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    words = K // 8
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        src, x_mask = columns_of_x(perm_ptr, ks, ks < K, HAS_PERM)
        a = tl.load(x_rows + src[None, :], mask=m_mask[:, None] & x_mask[None, :], other=0.0)
        ws = k0 // 8 + offs_w
        w_mask = n_mask[:, None] & (ws < words)[None, :]
        q, s, z = load_words(
            qw_ptr, s_ptr, z_ptr, rows[:, None], ws[None, :], w_mask,
            stride_qn, stride_sn, stride_zn, GROUP,
        )  # fmt: skip
        w = dequantize_words(q, z, s, BLOCK_N, BLOCK_K // 8)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ w.T, w in the int4 layout of kernels/w4a16.py; returns out.

    x: [m, k_in] (any row stride), fp32/fp16/bf16. qweight, scales, zeros, perm: the layout
    (contiguous last dimensions, any row strides). out (optional, written): [m, n] of x's
    dtype, contiguous rows of any stride. block_m, block_n, block_k: the tile (powers of two
    >= 16, as tl.dot needs, and block_k >= 32); the default, 16 x 32 x 128, was the best of
    13 tiles at 5 to 16 rows of Llama-3.1-8B's projections on an H200 (w4a16_matmul takes
    the GEMM up to 16 rows).
    """
    op = "w4a16_gemm"
    m, n, k = check_w4(op, x, qweight, scales, zeros, group_size, perm)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    for name, blk in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check_tile(op, name, blk)
    if block_k < 32:
        # two words a row: the H200's Triton compiled wrong products for every such tile
        # (block_n 16 to 64, 1 to 4 warps), while the interpreter's were right; from four
        # words a row they match the reference (.device check, 2026-11-29)
        raise ValueError(f"{op}: block_k must be at least 32, got {block_k}")
    check_launch(op, num_warps, num_stages)
    if m == 0 or n == 0:
        return out
    _w4a16_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        qweight,
        scales,
        zeros,
        qweight if perm is None else perm,  # never read without a perm
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        HAS_PERM=perm is not None,
        GROUP=group_size,
        PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out
