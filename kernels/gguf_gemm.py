"""A dequantising GEMM over GGUF blocks for the middle row counts: larger decode batches and
short extends, out[m, n] = x[m, :] . W[n, :].

Past kernels/gemv.MAX_M rows the GEMV's per-row registers run out, but a decode batch of 8 to
64 rows is still bound by reading W. Expanding W to bf16 first (kernels/gguf_matmul's path for
prefill) would read and write 4 more bytes per weight than the blocks hold; here each program
decodes a [BLOCK_N, BLOCK_K] tile of W in registers (kernels/gguf_blocks.py), casts it to x's
dtype and feeds tensor cores with tl.dot, so W's blocks are read once per BLOCK_M rows of x.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); the row tiles of x come first in launch order, so
the programs sharing one tile of W run together and all but the first find it in L2. fp32
accumulation, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_launch,
    check_tensor,
    check_tile,
    dot_precision,
)
from kernels.gguf_blocks import check_blocks, decode_groups
from kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    QTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows = offs_n.to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        gi = k0 // GROUP + tl.arange(0, GROUPS)
        w_mask = n_mask[:, None] & (gi < K // GROUP)[None, :]
        w = decode_groups(w_ptr, rows, gi, w_mask, QTYPE, GROUP)  # [BLOCK_N, GROUPS, GROUP]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = m_mask[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gguf_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    *,
    qtype: str,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ W.T, W [n, k] given as GGUF blocks [n, row bytes] of `qtype`; returns out.

    x: [m, k], a float dtype, any row stride; out (optional, written): [m, n] of x's dtype,
    any row stride. block_m, block_n, block_k: tile sizes (powers of two >= 16; block_k also
    a multiple of the type's scale group, kernels/gguf_blocks.LAYOUTS); block_m by default
    the smallest of 16, 32, 64 that covers m (fewer rows of a tile wasted on padding).
    """
    op = "gguf_gemm"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    lay = check_blocks(op, blocks, qtype, k, device=x.device)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check_tile(op, name, size)
    if block_k < lay.group:
        raise ValueError(f"{op}: block_k must be at least {lay.group} for {qtype}, got {block_k}")
    check_launch(op, num_warps, num_stages)
    if m == 0 or n == 0:
        return out
    _gguf_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        blocks,
        out,
        m,
        n,
        k,
        x.stride(0),
        blocks.stride(0),
        out.stride(0),
        QTYPE=lay.type_id,
        GROUP=lay.group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out
