"""Store new tokens' K and V into one layer's pool buffers at their slots, in one launch.

Token t's k[t] goes to k_buffer[out_cache_loc[t]] (v alike), cast to the buffer's dtype; an
fp8 pool gets the saturating cast of kernels/fp8_kv.py (scale 1.0).
Grid: (num_tokens, cdiv(num_kv_heads, BLOCK_H)); each program copies a [BLOCK_H, head_dim]
tile of K and the same tile of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, KV_DTYPES, check_device, check_tensor
from kernels.fp8_kv import FP8_FORMATS, store_into


@triton.jit
def _round_to_fp8_grid(
    x,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
):
    """x (fp32) clamped to [-FP8_MAX, FP8_MAX] and rounded to the nearest value of the fp8
    format (ties to even, subnormals included), still as fp32: the cast to fp8 is then exact.

    A GPU's conversion instruction rounds the same way by itself, but Triton's CPU
    interpreter truncates subnormals and rounds ties away from zero; rounding here first
    makes the kernel's bits equal torch's cast on both, so the interpreter can check them."""
    # NaN stays NaN, as in torch's clamp (the default maxnum semantics would drop it).
    x = tl.maximum(x, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    x = tl.minimum(x, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # The format's spacing at x is 2^quantum (subnormals: that of the smallest normal).
    quantum = tl.maximum(exponent, MIN_EXPONENT) - MANTISSA_BITS
    # Adding 1.5 * 2^(quantum + 23) leaves no fp32 bits below 2^quantum, so fp32's own
    # round-to-nearest-even does the rounding; subtracting it back is exact.
    magic = (((quantum + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    # The sign goes back by negation, so values rounding to zero keep it (-0.0), as in torch.
    return tl.where(bits < 0, -rounded, rounded)


def _fp8_constexprs(dtype: torch.dtype) -> dict[str, float | int | bool]:
    fmt = FP8_FORMATS.get(dtype)
    if fmt is None:
        return {"IS_FP8": False, "FP8_MAX": 0.0, "MANTISSA_BITS": 0, "MIN_EXPONENT": 0}
    return {
        "IS_FP8": True,
        "FP8_MAX": fmt.max,
        "MANTISSA_BITS": fmt.mantissa_bits,
        "MIN_EXPONENT": fmt.min_exponent,
    }


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
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
):
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    slot = tl.load(loc_ptr + tok * stride_loc).to(tl.int64)
    tok64 = tok.to(tl.int64)

    k = tl.load(k_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    if IS_FP8:
        k = _round_to_fp8_grid(k.to(tl.float32), FP8_MAX, MANTISSA_BITS, MIN_EXPONENT)
    dst = k_buf_ptr + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :]
    tl.store(dst, k.to(k_buf_ptr.dtype.element_ty), mask)

    v = tl.load(v_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    if IS_FP8:
        v = _round_to_fp8_grid(v.to(tl.float32), FP8_MAX, MANTISSA_BITS, MIN_EXPONENT)
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
    # One dtype for both buffers: the kernel's fp8 rounding is chosen once per launch.
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
    block_d = triton.next_power_of_2(head_dim)
    # About 2K elements per tile: one program per token for typical (8 heads x 128) shapes.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
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
        **_fp8_constexprs(k_buffer.dtype),
        num_warps=4,
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
