"""Skinny matmul over fp8 weights for decode: out[m, n] = x[m, :] . (q[n, :] * s) for at most
MAX_M rows, x in 16/32-bit floats, the weight read as 8-bit floats.

Batch-1 decode reads every weight once per token, so halving the bytes read is the speedup:
this is kernels/gemv.py (one program per BLOCK_N output rows streaming K in BLOCK_K chunks,
all M partial sums in registers, fp32 accumulation) with the weight loaded as fp8 and widened
in registers. Scales: per output row ([n, 1]: applied once to the finished sums) or per
128x128 block ([ceil(n/128), ceil(k/128)]: each tile is scaled as it is widened, so a chunk
of BLOCK_K columns, a multiple of 128, takes BLOCK_K / 128 scales per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.fp8_weights import BLOCK, FP8, dequantize
from kernels.gemv import MAX_M


@triton.jit
def _fp8_gemv_kernel(
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
    SCALE_BLOCK: tl.constexpr,  # 0: a scale per row; else the blocks' side (128)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
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
        if SCALE_BLOCK > 0:
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
    if SCALE_BLOCK == 0:
        row_scale = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn, mask=n_mask, other=0.0)
        acc0 *= row_scale
        acc1 *= row_scale
        acc2 *= row_scale
        acc3 *= row_scale
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_n, acc0.to(dtype), mask=n_mask)
    if M > 1:
        tl.store(out_ptr + stride_om + offs_n, acc1.to(dtype), mask=n_mask)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + offs_n, acc2.to(dtype), mask=n_mask)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + offs_n, acc3.to(dtype), mask=n_mask)


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
) -> torch.Tensor:
    """x @ (weight * scale).T for at most MAX_M rows; returns out.

    x: [m, k] float (any row stride, m <= MAX_M); weight: [n, k] float8_e4m3fn (any row
    stride); scale fp32: [n, 1] per row, or with block_scales [ceil(n/128), ceil(k/128)]
    per 128x128 block. out (optional, written): [m, n] in x's dtype.
    block_n, block_k: output rows per program and weight columns per step (powers of two;
    with block_scales block_k is a multiple of 128).
    """
    op = "fp8_gemv"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    check_tensor(
        op, "weight", weight, shape=(None, k), dims="[n, k]", dtypes=(FP8,), device=x.device
    )
    n = weight.shape[0]
    if block_scales:
        shape, dims = (-(-n // BLOCK), -(-k // BLOCK)), "[ceil(n/128), ceil(k/128)]"
    else:
        shape, dims = (n, 1), "[n, 1]"
    check_tensor(
        op, "scale", scale, shape=shape, dims=dims, dtypes=(torch.float32,), device=x.device,
        last_contiguous=block_scales,
    )  # fmt: skip
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    for name, blk in (("block_n", block_n), ("block_k", block_k)):
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {blk}")
    if block_scales and block_k % BLOCK:
        raise ValueError(f"{op}: block_k must be a multiple of {BLOCK} with block scales")
    if n == 0:
        return out
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        scale,
        out,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        M=m,
        SCALE_BLOCK=BLOCK if block_scales else 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fp8_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, block_scales: bool = False
) -> torch.Tensor:
    """The torch twin of `fp8_gemv`: the weight dequantized in fp32, one rounding at the end."""
    w = dequantize(weight, scale, BLOCK if block_scales else 0)
    return (x.float() @ w.T).to(x.dtype)
