"""Dequantising skinny matmul for decode: out = x @ w.T for a handful of rows of x, w int4 in
the layout of kernels/w4a16.py.

Decode reads every weight once per token; at 4 bits a weight that is 8 weights per 4-byte
word, so what limits the kernel is the instructions it spends per weight, not the bytes:
- a program owns BLOCK_N weight rows and walks K BLOCK_W words at a time. Each thread holds
  the same few consecutive words of every one of its rows, so x's 8 columns per word (and
  their sum) are loaded and converted once per step and reused down all BLOCK_N rows (an
  earlier version held x in the [rows, words] tile's layout and issued one load of x per
  weight: 18% of the copy bandwidth, bound by L1, as ncu showed);
- nibble j of a word becomes a float in one logic instruction and one add, exactly: AND-ed
  out in place and OR-ed into the exponent of 2^(23 - b) (b its lowest bit, at most 16), it
  is the float 2^(23 - b) + q, whose unit in the last place is 1; nibbles 5 to 7 are first
  shifted down 12 bits, once per word;
- the zero point never meets the weights: sum_j (q_j - z) x_j = sum_j q_j x_j - z sum_j x_j,
  and the group's scale multiplies a word's partial sum once.
That is three instructions per weight (and-or, add, fused multiply-add) for the first row of
x and one more for each further row. Rows of the tile are separate values, not a tensor
dimension, which keeps every tensor one-dimensional in the one layout of the packed words'
loads (no shared memory, no barriers in the loop).

Grid: (cdiv(N, BLOCK_N),); accumulation in fp32, one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launch, check_tensor
from kernels.gemv import MAX_M
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16 import PACK, check_w4, columns_of_x, load_words

# rows of the tile: each is spelled out in the kernel
MAX_BLOCK_N = 8


@triton.jit
def _nibble(word, BIT: tl.constexpr):
    """Bits BIT..BIT+3 (BIT <= 16) of uint32 `word` as floats 0..15, exactly."""
    bits = (word & (0xF << BIT)) | ((150 - BIT) << 23)
    return bits.to(tl.float32, bitcast=True) - 2.0 ** (23 - BIT)


@triton.jit
def _x_columns(x_row_ptr, perm_ptr, words, w_mask, HAS_PERM: tl.constexpr):
    """The 8 columns of x each word multiplies, as fp32 [BLOCK_W], and their sum."""
    c = words * 8
    s0, m0 = columns_of_x(perm_ptr, c, w_mask, HAS_PERM)
    s1, m1 = columns_of_x(perm_ptr, c + 1, w_mask, HAS_PERM)
    s2, m2 = columns_of_x(perm_ptr, c + 2, w_mask, HAS_PERM)
    s3, m3 = columns_of_x(perm_ptr, c + 3, w_mask, HAS_PERM)
    s4, m4 = columns_of_x(perm_ptr, c + 4, w_mask, HAS_PERM)
    s5, m5 = columns_of_x(perm_ptr, c + 5, w_mask, HAS_PERM)
    s6, m6 = columns_of_x(perm_ptr, c + 6, w_mask, HAS_PERM)
    s7, m7 = columns_of_x(perm_ptr, c + 7, w_mask, HAS_PERM)
    x0 = tl.load(x_row_ptr + s0, mask=m0, other=0.0).to(tl.float32)
    x1 = tl.load(x_row_ptr + s1, mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(x_row_ptr + s2, mask=m2, other=0.0).to(tl.float32)
    x3 = tl.load(x_row_ptr + s3, mask=m3, other=0.0).to(tl.float32)
    x4 = tl.load(x_row_ptr + s4, mask=m4, other=0.0).to(tl.float32)
    x5 = tl.load(x_row_ptr + s5, mask=m5, other=0.0).to(tl.float32)
    x6 = tl.load(x_row_ptr + s6, mask=m6, other=0.0).to(tl.float32)
    x7 = tl.load(x_row_ptr + s7, mask=m7, other=0.0).to(tl.float32)
    total = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    return (x0, x1, x2, x3, x4, x5, x6, x7, total)


@triton.jit
def _word_dot(lo, hi, xs):
    """sum_j q_j x_j over a word's 8 nibbles, [BLOCK_W] (lo: the word, hi: it >> 12)."""
    p = _nibble(lo, 0) * xs[0]
    p += _nibble(lo, 4) * xs[1]
    p += _nibble(lo, 8) * xs[2]
    p += _nibble(lo, 12) * xs[3]
    p += _nibble(lo, 16) * xs[4]
    p += _nibble(hi, 8) * xs[5]
    p += _nibble(hi, 12) * xs[6]
    p += _nibble(hi, 16) * xs[7]
    return p


@triton.jit
def _row_step(
    qw_ptr, s_ptr, z_ptr, n, N, words, w_mask, stride_qn, stride_sn, stride_zn,
    xs0, xs1, xs2, xs3, acc, M: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """One weight row's step: its BLOCK_W words against each row of x, added to `acc` (a
    tuple of MAX_M [BLOCK_W] partial sums, one per row of x; those past M untouched)."""
    mask = w_mask & ((n + 0 * words) < N)  # a vector: the interpreter takes no scalar masks
    q, s, z = load_words(
        qw_ptr, s_ptr, z_ptr, n.to(tl.int64), words, mask, stride_qn, stride_sn, stride_zn, GROUP
    )
    q = q.to(tl.uint32, bitcast=True)  # logical shifts: no sign to extend
    hi = q >> 12
    a0 = acc[0] + s * (_word_dot(q, hi, xs0) - z * xs0[8])
    a1 = acc[1]
    a2 = acc[2]
    a3 = acc[3]
    if M > 1:
        a1 += s * (_word_dot(q, hi, xs1) - z * xs1[8])
    if M > 2:
        a2 += s * (_word_dot(q, hi, xs2) - z * xs2[8])
    if M > 3:
        a3 += s * (_word_dot(q, hi, xs3) - z * xs3[8])
    return (a0, a1, a2, a3)


@triton.jit
def _store_row(out_ptr, stride_om, n, N, acc, M: tl.constexpr):
    """out[:M, n] = the sums of a weight row's partials, rounded to out's dtype."""
    dtype = out_ptr.dtype.element_ty
    ok = n < N
    tl.store(out_ptr + n, tl.sum(acc[0], axis=0).to(dtype), mask=ok)
    if M > 1:
        tl.store(out_ptr + stride_om + n, tl.sum(acc[1], axis=0).to(dtype), mask=ok)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + n, tl.sum(acc[2], axis=0).to(dtype), mask=ok)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + n, tl.sum(acc[3], axis=0).to(dtype), mask=ok)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K_in]
    qw_ptr,  # int32 [N, K / 8]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G]
    perm_ptr,  # int32 [K] (HAS_PERM)
    out_ptr,  # [M, N]
    N,
    NUM_WORDS,  # K / 8, passed (not derived from K) so that Triton sees its divisibility
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    M: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    offs_w = tl.arange(0, BLOCK_W)
    zero = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc0 = (zero, zero, zero, zero)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    for w0 in range(0, NUM_WORDS, BLOCK_W):
        words = w0 + offs_w
        w_mask = words < NUM_WORDS
        xs0 = _x_columns(x_ptr, perm_ptr, words, w_mask, HAS_PERM)
        xs1 = xs0
        xs2 = xs0
        xs3 = xs0
        if M > 1:
            xs1 = _x_columns(x_ptr + stride_xm, perm_ptr, words, w_mask, HAS_PERM)
        if M > 2:
            xs2 = _x_columns(x_ptr + 2 * stride_xm, perm_ptr, words, w_mask, HAS_PERM)
        if M > 3:
            xs3 = _x_columns(x_ptr + 3 * stride_xm, perm_ptr, words, w_mask, HAS_PERM)
        acc0 = _row_step(
            qw_ptr, s_ptr, z_ptr, n0, N, words, w_mask, stride_qn, stride_sn, stride_zn,
            xs0, xs1, xs2, xs3, acc0, M, GROUP,
        )  # fmt: skip
        if BLOCK_N > 1:
            acc1 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 1, N, words, w_mask, stride_qn, stride_sn, stride_zn,
                xs0, xs1, xs2, xs3, acc1, M, GROUP,
            )  # fmt: skip
        if BLOCK_N > 2:
            acc2 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 2, N, words, w_mask, stride_qn, stride_sn, stride_zn,
                xs0, xs1, xs2, xs3, acc2, M, GROUP,
            )  # fmt: skip
            acc3 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 3, N, words, w_mask, stride_qn, stride_sn, stride_zn,
                xs0, xs1, xs2, xs3, acc3, M, GROUP,
            )  # fmt: skip
        if BLOCK_N > 4:
            acc4 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 4, N, words, w_mask, stride_qn, stride_sn, stride_zn,
                xs0, xs1, xs2, xs3, acc4, M, GROUP,
            )  # fmt: skip
            acc5 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 5, N, words, w_mask, stride_qn, stride_sn, stride_zn,
                xs0, xs1, xs2, xs3, acc5, M, GROUP,
            )  # fmt: skip
            acc6 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 6, N, words, w_mask, stride_qn, stride_sn, stride_zn,
                xs0, xs1, xs2, xs3, acc6, M, GROUP,
            )  # fmt: skip
            acc7 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 7, N, words, w_mask, stride_qn, stride_sn, stride_zn,
                xs0, xs1, xs2, xs3, acc7, M, GROUP,
            )  # fmt: skip
    _store_row(out_ptr, stride_om, n0, N, acc0, M)
    if BLOCK_N > 1:
        _store_row(out_ptr, stride_om, n0 + 1, N, acc1, M)
    if BLOCK_N > 2:
        _store_row(out_ptr, stride_om, n0 + 2, N, acc2, M)
        _store_row(out_ptr, stride_om, n0 + 3, N, acc3, M)
    if BLOCK_N > 4:
        _store_row(out_ptr, stride_om, n0 + 4, N, acc4, M)
        _store_row(out_ptr, stride_om, n0 + 5, N, acc5, M)
        _store_row(out_ptr, stride_om, n0 + 6, N, acc6, M)
        _store_row(out_ptr, stride_om, n0 + 7, N, acc7, M)


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 2,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ w.T for at most MAX_M rows of x, w in the int4 layout of kernels/w4a16.py; returns out.

    x: [m, k_in] (any row stride, m <= MAX_M), fp32/fp16/bf16. qweight, scales, zeros, perm:
    the layout (contiguous last dimensions, any row strides). out (optional, written): [m, n]
    of x's dtype, contiguous rows of any stride. block_n: weight rows per program (1, 2, 4 or
    8); block_k: weight columns per step (block_k / 8 words; a power of two, at least 8).
    """
    op = "w4a16_gemv"
    m, n, k = check_w4(op, x, qweight, scales, zeros, group_size, perm)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    if block_n not in (1, 2, 4, MAX_BLOCK_N):
        raise ValueError(f"{op}: block_n must be 1, 2, 4 or {MAX_BLOCK_N}, got {block_n}")
    if block_k < PACK or block_k & (block_k - 1):
        raise ValueError(f"{op}: block_k must be a power of two of at least {PACK}, got {block_k}")
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
        k // PACK,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        M=m,
        HAS_PERM=perm is not None,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_W=block_k // PACK,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out
