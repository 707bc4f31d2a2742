"""fp8 skinny matmul for decode in packed half-precision math: out[m, n] = x[m, :] . (q[n, :] *
s) for at most MAX_M rows of 16-bit x, whole tiles only (kernels/fp8_gemv.py takes the rest).

kernels/gemv.py's fp8 variant widens every weight to fp32 (an e4m3 pair to an fp16 pair, then
each half to fp32) and multiplies it in fp32: about five sm_90 instructions a weight, a byte,
where bf16's kernel spends about three a byte; its GEMVs read fp8 at 62% to 88% of the
bandwidth bf16's reach. Here the products are fp16x2 fused multiply-adds on the pairs the
conversion gives, one instruction a weight with the conversion:
- a thread reads 4 consecutive words (16 weights) of a row a step, one 16-byte load, and x's
  16 columns for them once a step for all BLOCK_N rows (as kernels/w4a16_gemv.py does);
- x is brought into fp16's range per thread and step: its 16 columns are scaled by the power
  of two that puts their largest magnitude in [8, 16), exact for every bf16 value down to
  2^-21 of that largest (fp16 keeps bf16's 8 mantissa bits), so each fp16 sum of a lane's
  8 products (|e4m3| <= 448) stays under 8 * 448 * 16 = 57,344 < 65,504;
- a lane's 8 products are summed in fp16 (one rounding each, 2^-11 of that partial sum), the
  two lanes' sums widened to fp32, unscaled (and multiplied by the 128x128 block's scale)
  and added to the row's fp32 partial; the per-row scale multiplies the finished sums.

The fp16x2 instructions are inline PTX; under the Triton interpreter (no PTX) the same
arithmetic runs in fp32 rounded to fp16 where the GPU rounds (`EMULATE`).

Grid: (N / BLOCK_N,).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import interpreting
from kernels._math import halves_f32, store_row_sums, zero_row_sums
from kernels.f16x2 import fma2, lanes_sum, pack, split4, x_scaling, zero_pair
from kernels.pdl import pdl_launch, pdl_prologue

# consecutive 4-byte words of a row a thread reads a step: 16 weights, one 16-byte load
V: tl.constexpr = tl.constexpr(4)
BLOCK_NS = (1, 2, 4, 8)
# columns a warp covers a step: 32 threads of 16 weights
PACKED_K = 32 * 16


@triton.jit
def _e4m3_pairs(word, EMULATE: tl.constexpr):
    """A word's 4 e4m3 weights as two fp16 pairs: bytes (0, 1) and (2, 3), exact."""
    if EMULATE:  # the interpreter's word: its 4 weights, already widened
        pairs = (word[0], word[1]), (word[2], word[3])
    else:
        pairs = tl.inline_asm_elementwise(
            "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\n"
            "cvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}",
            "=r,=r,r",
            [word],
            dtype=(tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )
    return pairs


@triton.jit
def _x_step(x_row_ptr, words, EMULATE: tl.constexpr):
    """A row of x's columns for a step's words ([T, V]; word w holds columns 4w..4w+3): per
    word two fp16 pairs, (4w, 4w+1) and (4w+2, 4w+3), scaled by the thread's power of two,
    as 2V [T] values, and the inverse of that power: [T]."""
    bf16: tl.constexpr = x_row_ptr.dtype.element_ty == tl.bfloat16
    q = tl.load(x_row_ptr.to(tl.pointer_type(tl.uint64)) + words)  # a word's 4 columns
    x0, x1 = halves_f32(q.to(tl.uint32), bf16)
    x2, x3 = halves_f32((q >> 32).to(tl.uint32), bf16)
    big = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    scale, unscale = x_scaling(tl.max(big, axis=1))
    a0, a1, a2, a3 = split4(x0 * scale)
    b0, b1, b2, b3 = split4(x1 * scale)
    c0, c1, c2, c3 = split4(x2 * scale)
    d0, d1, d2, d3 = split4(x3 * scale)
    return (
        pack(a0, b0, EMULATE), pack(c0, d0, EMULATE),
        pack(a1, b1, EMULATE), pack(c1, d1, EMULATE),
        pack(a2, b2, EMULATE), pack(c2, d2, EMULATE),
        pack(a3, b3, EMULATE), pack(c3, d3, EMULATE),
        unscale,
    )  # fmt: skip


@triton.jit
def _row_words(w_ptr, row, stride_wn, stride_ww, words, EMULATE: tl.constexpr):
    """A weight row's words for the step ([T, V]), as V [T] words (the interpreter: as V
    tuples of their 4 weights in fp32)."""
    if EMULATE:
        cols = w_ptr + row * stride_wn + words * 4
        w0 = tl.load(cols).to(tl.float32)
        w1 = tl.load(cols + 1).to(tl.float32)
        w2 = tl.load(cols + 2).to(tl.float32)
        w3 = tl.load(cols + 3).to(tl.float32)
        a0, a1, a2, a3 = split4(w0)
        b0, b1, b2, b3 = split4(w1)
        c0, c1, c2, c3 = split4(w2)
        d0, d1, d2, d3 = split4(w3)
        ws = (a0, b0, c0, d0), (a1, b1, c1, d1), (a2, b2, c2, d2), (a3, b3, c3, d3)
    else:
        ws = split4(tl.load(w_ptr.to(tl.pointer_type(tl.uint32)) + row * stride_ww + words))
    return ws


@triton.jit
def _words_dot(ws, xs, step_scale, acc, EMULATE: tl.constexpr):
    """acc + step_scale * (the row's V words . one row of x's pairs `xs`), the products
    summed in fp16 pairs (8 a lane), then in fp32: [T]."""
    T: tl.constexpr = acc.shape[0]
    p = zero_pair(T, EMULATE)
    for j in tl.static_range(4):
        lo, hi = _e4m3_pairs(ws[j], EMULATE)
        p = fma2(lo, xs[2 * j], p, EMULATE)
        p = fma2(hi, xs[2 * j + 1], p, EMULATE)
    return acc + lanes_sum(p, EMULATE) * step_scale


@triton.jit
def _row_step(w_ptr, row, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc, M: tl.constexpr,
              EMULATE: tl.constexpr):  # fmt: skip
    """One weight row's step against each of the M rows of x (acc: a tuple of 4 [T] partial
    sums, those past M untouched)."""
    ws = _row_words(w_ptr, row, stride_wn, stride_ww, words, EMULATE)
    a0 = _words_dot(ws, x0, x0[8] * bscale, acc[0], EMULATE)
    a1 = acc[1]
    a2 = acc[2]
    a3 = acc[3]
    if M > 1:
        a1 = _words_dot(ws, x1, x1[8] * bscale, a1, EMULATE)
    if M > 2:
        a2 = _words_dot(ws, x2, x2[8] * bscale, a2, EMULATE)
    if M > 3:
        a3 = _words_dot(ws, x3, x3[8] * bscale, a3, EMULATE)
    return a0, a1, a2, a3


@triton.jit
def _fp8_gemv_packed_kernel(
    x_ptr,  # [M, K] 16-bit
    w_ptr,  # [N, K] e4m3
    s_ptr,  # fp32 [N, 1] or [N / 128, K / 128]
    out_ptr,  # [M, N]
    NUM_WORDS,  # K / 4
    stride_xm,
    stride_wn,
    stride_ww,  # stride_wn / 4: words
    stride_sn,
    stride_om,
    M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,  # 0: a scale per row, else the blocks' side
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # words a step: 4 per thread
    EMULATE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    T: tl.constexpr = BLOCK_W // V
    offs_w = tl.arange(0, T)[:, None] * V + tl.arange(0, V)[None, :]
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = zero_row_sums(T)
    for w0 in range(0, NUM_WORDS, BLOCK_W):
        words = w0 + offs_w
        x0 = _x_step(x_ptr, words, EMULATE)
        x1 = x0
        x2 = x0
        x3 = x0
        if M > 1:
            x1 = _x_step(x_ptr + stride_xm, words, EMULATE)
        if M > 2:
            x2 = _x_step(x_ptr + 2 * stride_xm, words, EMULATE)
        if M > 3:
            x3 = _x_step(x_ptr + 3 * stride_xm, words, EMULATE)
        if SCALE_BLOCK > 0:  # the block of each thread's 16 columns; the program's rows share one
            first = (w0 + tl.arange(0, T) * V) * 4
            bscale = tl.load(s_ptr + (n0 // SCALE_BLOCK) * stride_sn + first // SCALE_BLOCK)
        else:
            bscale = 1.0
        r = n0.to(tl.int64)
        acc0 = _row_step(
            w_ptr, r, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc0, M, EMULATE
        )
        if BLOCK_N > 1:
            acc1 = _row_step(
                w_ptr, r + 1, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc1, M, EMULATE
            )
        if BLOCK_N > 2:
            acc2 = _row_step(
                w_ptr, r + 2, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc2, M, EMULATE
            )
            acc3 = _row_step(
                w_ptr, r + 3, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc3, M, EMULATE
            )
        if BLOCK_N > 4:
            acc4 = _row_step(
                w_ptr, r + 4, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc4, M, EMULATE
            )
            acc5 = _row_step(
                w_ptr, r + 5, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc5, M, EMULATE
            )
            acc6 = _row_step(
                w_ptr, r + 6, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc6, M, EMULATE
            )
            acc7 = _row_step(
                w_ptr, r + 7, stride_wn, stride_ww, words, x0, x1, x2, x3, bscale, acc7, M, EMULATE
            )
    RS: tl.constexpr = SCALE_BLOCK == 0
    store_row_sums(out_ptr, stride_om, n0, s_ptr, stride_sn, acc0, M, RS)
    if BLOCK_N > 1:
        store_row_sums(out_ptr, stride_om, n0 + 1, s_ptr, stride_sn, acc1, M, RS)
    if BLOCK_N > 2:
        store_row_sums(out_ptr, stride_om, n0 + 2, s_ptr, stride_sn, acc2, M, RS)
        store_row_sums(out_ptr, stride_om, n0 + 3, s_ptr, stride_sn, acc3, M, RS)
    if BLOCK_N > 4:
        store_row_sums(out_ptr, stride_om, n0 + 4, s_ptr, stride_sn, acc4, M, RS)
        store_row_sums(out_ptr, stride_om, n0 + 5, s_ptr, stride_sn, acc5, M, RS)
        store_row_sums(out_ptr, stride_om, n0 + 6, s_ptr, stride_sn, acc6, M, RS)
        store_row_sums(out_ptr, stride_om, n0 + 7, s_ptr, stride_sn, acc7, M, RS)


def packed_fits(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int) -> bool:
    """Whether the packed kernel takes this product whole (else kernels/gemv.py's fp8 variant):
    16-bit x with 8-byte aligned rows, rows of weight 16-byte aligned, whole tiles."""
    n, k = weight.shape
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and x.data_ptr() % 8 == 0
        and x.stride(0) % 4 == 0
        and weight.stride(1) == 1
        and weight.data_ptr() % 16 == 0
        and weight.stride(0) % 16 == 0
        and block_n in BLOCK_NS
        and block_k % PACKED_K == 0
        and n % block_n == 0
        and k % block_k == 0
    )


def launch_packed(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    *,
    scale_block: int,
    block_n: int,
    block_k: int,
    num_stages: int,
) -> None:
    """The packed kernel over checked arguments that `packed_fits`; a step of block_k columns
    is block_k / 16 threads (block_k / PACKED_K warps)."""
    n, k = weight.shape
    _fp8_gemv_packed_kernel[(n // block_n,)](
        x,
        weight,
        scale,
        out,
        k // 4,
        x.stride(0),
        weight.stride(0),
        weight.stride(0) // 4,
        scale.stride(0),
        out.stride(0),
        M=x.shape[0],
        SCALE_BLOCK=scale_block,
        BLOCK_N=block_n,
        BLOCK_W=block_k // 4,
        EMULATE=interpreting(),
        num_warps=block_k // PACKED_K,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
