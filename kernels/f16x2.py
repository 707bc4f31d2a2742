"""Pairs of fp16 values in one 32-bit register, for GEMVs whose products are fp16x2 fused
multiply-adds (kernels/fp8_gemv_packed.py).

A pair is a uint32 (low lane in the low half) operated on by inline PTX. Under the Triton
interpreter, which runs no PTX, every function takes `EMULATE` and a pair is a tuple of two
fp32 tensors holding fp16 values, each operation rounded to fp16 where the GPU rounds.

`x_scaling` brings 16-bit activations into fp16's range: a thread's columns are scaled by
the power of two that puts their largest magnitude in [8, 16), so fp16 keeps bf16's 8
mantissa bits for every value down to 2^-21 of that largest, and sums of n products with
weights of magnitude w stay under 16 n w.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def r16(v):
    """v (fp32) rounded to fp16, as fp32 (the interpreter's stand-in for an fp16 register)."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def split4(a):
    """The 4 columns of [T, 4] `a` (a thread's own values) as four [T] tensors."""
    a02, a13 = tl.split(tl.reshape(a, [a.shape[0], 2, 2]))
    a0, a2 = tl.split(a02)
    a1, a3 = tl.split(a13)
    return a0, a1, a2, a3


@triton.jit
def pack(lo, hi, EMULATE: tl.constexpr):
    """fp32 lo and hi rounded to an fp16 pair (a uint32, lo in the low half)."""
    if EMULATE:
        pair = (r16(lo), r16(hi))
    else:
        pair = tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.uint32, is_pure=True,
            pack=1,
        )  # fmt: skip
    return pair


@triton.jit
def fma2(a, b, c, EMULATE: tl.constexpr):
    """a * b + c on fp16 pairs, each lane rounded once."""
    if EMULATE:
        d = (r16(a[0] * b[0] + c[0]), r16(a[1] * b[1] + c[1]))
    else:
        d = tl.inline_asm_elementwise(
            "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.uint32,
            is_pure=True, pack=1,
        )  # fmt: skip
    return d


@triton.jit
def lanes_sum(p, EMULATE: tl.constexpr):
    """An fp16 pair's two lanes widened to fp32 and added."""
    if EMULATE:
        total = p[0] + p[1]
    else:
        total = tl.inline_asm_elementwise(
            "{\n.reg .b16 lo, hi;\n.reg .f32 a, b;\nmov.b32 {lo, hi}, $1;\n"
            "cvt.f32.f16 a, lo;\ncvt.f32.f16 b, hi;\nadd.f32 $0, a, b;\n}",
            "=f,r",
            [p],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return total


@triton.jit
def zero_pair(T: tl.constexpr, EMULATE: tl.constexpr):
    """[T] fp16 pairs of zeros."""
    if EMULATE:
        z = tl.zeros([T], dtype=tl.float32)
        pair = (z, z)
    else:
        pair = tl.zeros([T], dtype=tl.uint32)
    return pair


@triton.jit
def x_scaling(big):
    """For a thread's largest |x| (fp32, [T]): the power of two that scales it into [8, 16),
    [T, 1], and its inverse, [T]. NaN is ignored by the max that gives `big` and stays in x;
    infinities (and a NaN max) hold exponent 255, clamped, so their products are inf or NaN
    as in fp32; zero and subnormal maxima take the largest scale."""
    e = big.to(tl.int32, bitcast=True) >> 23  # the exponent field (big >= 0)
    e = tl.minimum(tl.maximum(e, 4), 254)
    scale = ((257 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(130 - e)
    unscale = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 130)
    return scale, unscale
