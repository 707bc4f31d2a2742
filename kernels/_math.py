"""Device math shared by several kernels: tanh (Triton has none of its own on every backend), a
uint32 of two 16-bit floats widened to fp32, and the GEMVs' partial sums per weight row."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from one exp of a non-positive argument: no overflow for any x."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def halves_f32(pair, BF16: tl.constexpr):
    """The two 16-bit floats (bf16, else fp16) of uint32 `pair`, low first, as fp32."""
    if BF16:  # a bf16 is the top half of its fp32
        return (pair << 16).to(tl.float32, bitcast=True), (pair & 0xFFFF0000).to(
            tl.float32, bitcast=True
        )
    lo = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def zero_row_sums(T: tl.constexpr):
    """The partial sums of a GEMV program's 8 weight rows (kernels/w4a16_gemv.py,
    kernels/fp8_gemv_packed.py): per row a tuple of 4 (one per row of x) fp32 [T] zeros."""
    z = tl.zeros([T], dtype=tl.float32)
    row = (z, z, z, z)
    return row, row, row, row, row, row, row, row


@triton.jit
def store_row_sums(
    out_ptr, stride_om, n, s_ptr, stride_sn, acc, M: tl.constexpr, ROW_SCALES: tl.constexpr
):
    """out[:M, n] = the sums of a weight row's partials (`acc`, as zero_row_sums gives them),
    times the row's scale s_ptr[n * stride_sn] with ROW_SCALES, rounded to out's dtype."""
    dtype = out_ptr.dtype.element_ty
    s = 1.0
    if ROW_SCALES:
        s = tl.load(s_ptr + n.to(tl.int64) * stride_sn)
    tl.store(out_ptr + n, (tl.sum(acc[0], axis=0) * s).to(dtype))
    if M > 1:
        tl.store(out_ptr + stride_om + n, (tl.sum(acc[1], axis=0) * s).to(dtype))
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + n, (tl.sum(acc[2], axis=0) * s).to(dtype))
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + n, (tl.sum(acc[3], axis=0) * s).to(dtype))
