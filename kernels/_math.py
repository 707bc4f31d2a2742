"""Device math shared by several kernels: tanh (Triton has none of its own on every backend), a
uint32 of two 16-bit floats widened to fp32, and the GEMVs' zeroed partial sums."""

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
