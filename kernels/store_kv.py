"""Store new tokens' K and V into one layer's pool buffers at their slots, in one launch.

Token t's k[t] goes to k_buffer[out_cache_loc[t]] (v alike), cast to the buffer's dtype; an
fp8 pool gets the saturating cast of kernels/fp8_kv.py (scale 1.0), done by torch before the
kernel copies its bytes.
Grid: (num_tokens, cdiv(num_kv_heads, BLOCK_H)); each program copies a [BLOCK_H, head_dim]
tile of K and the same tile of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    KV_DTYPES,
    check_device,
    check_tensor,
    next_pow2,
)
from kernels.fp8_kv import FP8_FORMATS, quantize_kv, store_into
from kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_buf_ptr,
    v_buf_ptr,
    loc_ptr,
    stride_loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    slot = tl.load(loc_ptr + tok * stride_loc).to(tl.int64)
    tok64 = tok.to(tl.int64)

    k = tl.load(k_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    dst = k_buf_ptr + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :]
    tl.store(dst, k.to(k_buf_ptr.dtype.element_ty), mask)

    v = tl.load(v_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    dst = v_buf_ptr + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(dst, v.to(v_buf_ptr.dtype.element_ty), mask)


def store_kv(
    *,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """k_buffer[out_cache_loc] = k; v_buffer[out_cache_loc] = v (cast to the buffers' dtype,
    saturating for fp8: `quantize_kv`).

    k, v: [num_tokens, num_kv_heads, head_dim], any token/head strides.
    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim], both of one dtype: a float dtype
    or float8_e5m2 / float8_e4m3fn.
    out_cache_loc: [num_tokens] int32/int64 slots, each < num_slots (not checked: that would
    need a host sync). Two tokens with the same slot leave either one's K/V there.
    """
    op = "store_kv"
    check_tensor(op, "k", k, shape=(None, None, None), dims="[n, kv_heads, d]", dtypes=FLOAT_DTYPES)
    n, num_kv_heads, head_dim = k.shape
    device = k.device
    check_device(op, k)
    check_tensor(
        op, "v", v, shape=k.shape, dims="[n, kv_heads, d]", dtypes=FLOAT_DTYPES, device=device
    )
    buf_shape = (None, num_kv_heads, head_dim)
    # One dtype for both buffers: an fp8 pool is cast once per launch.
    for name, buf, dtypes in (
        ("k_buffer", k_buffer, KV_DTYPES),
        ("v_buffer", v_buffer, (k_buffer.dtype,)),
    ):
        check_tensor(
            op,
            name,
            buf,
            shape=buf_shape,
            dims="[slots, kv_heads, d]",
            dtypes=dtypes,
            device=device,
        )
    check_tensor(
        op,
        "out_cache_loc",
        out_cache_loc,
        shape=(n,),
        dims="[n]",
        dtypes=INDEX_DTYPES,
        device=device,
        last_contiguous=False,
    )
    if n == 0:
        return
    if k_buffer.dtype in FP8_FORMATS:
        # torch's saturating cast, then a byte copy: the pool's bits are the reference's by
        # construction on every device. (Rounding in the kernel matched torch's cast in the
        # CPU interpreter but not on an H100, where some bytes differed.) The cast's extra
        # launches sit inside the decode CUDA graph; a prefill pays a few per layer.
        k = quantize_kv(k, k_buffer.dtype).view(torch.uint8)
        v = quantize_kv(v, v_buffer.dtype).view(torch.uint8)
        k_buffer, v_buffer = k_buffer.view(torch.uint8), v_buffer.view(torch.uint8)
    block_d = next_pow2(head_dim)
    # About 2K elements per tile: one program per token for typical (8 heads x 128) shapes.
    block_h = min(next_pow2(num_kv_heads), max(1, 2048 // block_d))
    grid = (n, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        k,
        v,
        k_buffer,
        v_buffer,
        out_cache_loc,
        out_cache_loc.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
        **pdl_launch(k.device),
    )


def store_kv_ref(
    *,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """The torch twin of `store_kv` (what KVPool.set_kv does)."""
    store_into(k_buffer, out_cache_loc, k)
    store_into(v_buffer, out_cache_loc, v)
