"""Dequantising skinny matmul for decode: out = x @ w.T for a handful of rows of x, w int4 in
the layout of kernels/w4a16.py.

Decode reads every weight once per token; at 4 bits a weight that is 8 weights per 4-byte
word, so the kernel must spend few instructions per weight and few L1 accesses per step:
- a program owns BLOCK_N weight rows and walks K BLOCK_W words a step. A thread holds V (4)
  consecutive words of each of its rows (one 16-byte load a row), all in one quantisation
  group, so the group's scale and zero point are loaded once a row and step; x's columns for
  those words are loaded and converted once a step for all BLOCK_N rows (16-bit x as 8-byte
  loads: the L1 serves a warp's load per cache line touched, and 2-byte loads of x made it
  the bottleneck, 77% busy with the DRAM at 35%, as ncu showed);
- a nibble becomes a float in one AND: left in place at bits BIT..BIT+3 (BIT <= 16; nibbles
  5 to 7 shifted down 12 bits once per word), the bits are the subnormal float q 2^(BIT - 149),
  exact, and x's column is scaled by 2^(X_EXP - BIT) once a step, so each product is one
  fused multiply-add, q x 2^(X_EXP - 149) (fp32 arithmetic here keeps subnormals; sums are
  scaled back once at the store);
- the zero point never meets the weights: sum_j (q_j - z) x_j = sum_j q_j x_j - z sum_j x_j,
  and the group's scale multiplies a thread's partial sum for the step once.
That is about two instructions per weight (AND, FMA) for the first row of x and one more for
each further row. Rows of the tile are separate values, not a tensor dimension, and the
words a [T, V] tile whose V lies in one thread, which keeps every tensor in the one layout of
the packed words' loads (no shared memory, no barriers in the loop). Launches whose rows and
steps are whole read their words without masks. An act-order perm is applied to x once
before the launch (kernels/gather_cols.py).

Grid: (cdiv(N, BLOCK_N),); accumulation in fp32, one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launch, check_tensor
from kernels._math import halves_f32, zero_row_sums
from kernels.gather_cols import gather_columns
from kernels.gemv import MAX_M
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16 import PACK, check_w4

# rows of the tile: each is spelled out in the kernel
MAX_BLOCK_N = 8
# x is scaled by 2^(X_EXP - BIT) for a nibble kept at bits BIT.. (a subnormal q 2^(BIT - 149)):
# products q x 2^(X_EXP - 149), normal (every bit kept) down to |q x| of 2^-57 (7e-18), and x
# below 2^48 (3e14) in magnitude stays finite. The sums are scaled back once, at the store.
X_EXP: tl.constexpr = tl.constexpr(80)
# consecutive words a thread reads per row and step (one 16-byte load)
WORDS_PER_THREAD = 4


@triton.jit
def _nibble(word, BIT: tl.constexpr):
    """Bits BIT..BIT+3 (BIT <= 16) of uint32 `word`, AND-ed out in place, as the float they
    spell: q 2^(BIT - 149) for q = 0..15, a subnormal, exact (fp32 arithmetic here keeps
    subnormals: the products are not flushed)."""
    return (word & (0xF << BIT)).to(tl.float32, bitcast=True)


@triton.jit
def _x_columns(x_row_ptr, words, w_mask, WIDE_X: tl.constexpr):
    """The 8 columns of x each word ([T, V]) multiplies, in fp32 times 2^(X_EXP - BIT) for
    the bit BIT its nibble has in _word_dot (undoing the nibble's 2^(BIT - 149)), and per
    thread row t the sum of its 8V columns times 2^(X_EXP - 149): [T]."""
    c = words * 8
    if WIDE_X:
        # a word's 8 columns of 16-bit x in two 8-byte loads: the L1 serves a warp's load by
        # the cache lines it touches, and 8 2-byte loads a word touched each line 4x as often
        # (ncu: the L1 77% busy, the DRAM 35%)
        bf16: tl.constexpr = x_row_ptr.dtype.element_ty == tl.bfloat16
        x_pairs = x_row_ptr.to(tl.pointer_type(tl.uint64)) + 2 * words
        lo = tl.load(x_pairs)
        hi = tl.load(x_pairs + 1)
        x0, x1 = halves_f32(lo.to(tl.uint32), bf16)
        x2, x3 = halves_f32((lo >> 32).to(tl.uint32), bf16)
        x4, x5 = halves_f32(hi.to(tl.uint32), bf16)
        x6, x7 = halves_f32((hi >> 32).to(tl.uint32), bf16)
    else:  # column by column (fp32 x, rows not 8-byte aligned, a partial step)
        x0 = tl.load(x_row_ptr + c, mask=w_mask, other=0.0).to(tl.float32)
        x1 = tl.load(x_row_ptr + c + 1, mask=w_mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row_ptr + c + 2, mask=w_mask, other=0.0).to(tl.float32)
        x3 = tl.load(x_row_ptr + c + 3, mask=w_mask, other=0.0).to(tl.float32)
        x4 = tl.load(x_row_ptr + c + 4, mask=w_mask, other=0.0).to(tl.float32)
        x5 = tl.load(x_row_ptr + c + 5, mask=w_mask, other=0.0).to(tl.float32)
        x6 = tl.load(x_row_ptr + c + 6, mask=w_mask, other=0.0).to(tl.float32)
        x7 = tl.load(x_row_ptr + c + 7, mask=w_mask, other=0.0).to(tl.float32)
    total = tl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), axis=1)
    return (
        x0 * 2.0**X_EXP,
        x1 * 2.0 ** (X_EXP - 4),
        x2 * 2.0 ** (X_EXP - 8),
        x3 * 2.0 ** (X_EXP - 12),
        x4 * 2.0 ** (X_EXP - 16),
        x5 * 2.0 ** (X_EXP - 8),
        x6 * 2.0 ** (X_EXP - 12),
        x7 * 2.0 ** (X_EXP - 16),
        total * 2.0 ** (X_EXP - 149),
    )


@triton.jit
def _word_dot(q, xs):
    """2^(X_EXP - 149) sum_j q_j x_j over each word's 8 nibbles, summed over a thread's V
    words: [T]. Nibbles 5 to 7 are first shifted down 12 bits (once per word) so that no
    nibble reaches the exponent."""
    hi = q >> 12
    p = _nibble(q, 0) * xs[0]
    p += _nibble(q, 4) * xs[1]
    p += _nibble(q, 8) * xs[2]
    p += _nibble(q, 12) * xs[3]
    p += _nibble(q, 16) * xs[4]
    p += _nibble(hi, 8) * xs[5]
    p += _nibble(hi, 12) * xs[6]
    p += _nibble(hi, 16) * xs[7]
    return tl.sum(p, axis=1)


@triton.jit
def _row_step(
    qw_ptr, s_ptr, z_ptr, n, N, words, w_mask, groups, g_mask, stride_qn, stride_sn, stride_zn,
    xs0, xs1, xs2, xs3, acc, M: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """One weight row's step: its words ([T, V]) against each row of x, added to `acc` (a
    tuple of MAX_M [T] partial sums, one per row of x; those past M untouched). A thread's V
    words lie in one group (`groups`, [T]): its scale and zero point are loaded once."""
    row = n.to(tl.int64)
    if EVEN:  # every row and word in range: no masks, no predicated loads
        q = tl.load(qw_ptr + row * stride_qn + words)
        s = tl.load(s_ptr + row * stride_sn + groups).to(tl.float32)
        z = tl.load(z_ptr + row * stride_zn + groups).to(tl.float32)
    else:  # masks as vectors: the interpreter takes no scalar masks
        q = tl.load(qw_ptr + row * stride_qn + words, mask=w_mask & (n + 0 * words < N), other=0)
        g_ok = g_mask & (n + 0 * groups < N)
        s = tl.load(s_ptr + row * stride_sn + groups, mask=g_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * stride_zn + groups, mask=g_ok, other=0).to(tl.float32)
    q = q.to(tl.uint32, bitcast=True)  # logical shifts: no sign to extend
    # sum_j (q_j - z) x_j = sum_j q_j x_j - z sum_j x_j, all times 2^(X_EXP - 149)
    a0 = acc[0] + s * (_word_dot(q, xs0) - z * xs0[8])
    a1 = acc[1]
    a2 = acc[2]
    a3 = acc[3]
    if M > 1:
        a1 += s * (_word_dot(q, xs1) - z * xs1[8])
    if M > 2:
        a2 += s * (_word_dot(q, xs2) - z * xs2[8])
    if M > 3:
        a3 += s * (_word_dot(q, xs3) - z * xs3[8])
    return (a0, a1, a2, a3)


@triton.jit
def _store_row(out_ptr, stride_om, n, N, acc, M: tl.constexpr):
    """out[:M, n] = the sums of a weight row's partials, scaled back by 2^(149 - X_EXP)
    (exact) and rounded to out's dtype."""
    dtype = out_ptr.dtype.element_ty
    ok = n < N
    unscale: tl.constexpr = 2.0 ** (149 - X_EXP)
    tl.store(out_ptr + n, (tl.sum(acc[0], axis=0) * unscale).to(dtype), mask=ok)
    if M > 1:
        tl.store(out_ptr + stride_om + n, (tl.sum(acc[1], axis=0) * unscale).to(dtype), mask=ok)
    if M > 2:
        out2 = (tl.sum(acc[2], axis=0) * unscale).to(dtype)
        tl.store(out_ptr + 2 * stride_om + n, out2, mask=ok)
    if M > 3:
        out3 = (tl.sum(acc[3], axis=0) * unscale).to(dtype)
        tl.store(out_ptr + 3 * stride_om + n, out3, mask=ok)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K_in]
    qw_ptr,  # int32 [N, K / 8]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G]
    out_ptr,  # [M, N]
    N,
    NUM_WORDS,  # K / 8, passed (not derived from K) so that Triton sees its divisibility
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    M: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    V: tl.constexpr,  # words per thread row: consecutive, in one group
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and NUM_WORDS % BLOCK_W == 0
    WIDE_X: tl.constexpr,  # EVEN, x 16-bit with 8-byte aligned rows: read 8 bytes a load
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    T: tl.constexpr = BLOCK_W // V
    offs_w = tl.arange(0, T)[:, None] * V + tl.arange(0, V)[None, :]  # [T, V]
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = zero_row_sums(T)
    for w0 in range(0, NUM_WORDS, BLOCK_W):
        words = w0 + offs_w
        first = w0 + tl.arange(0, T) * V  # each thread row's first word
        groups = first // (GROUP // 8)
        w_mask = words < NUM_WORDS
        g_mask = first < NUM_WORDS
        xs0 = _x_columns(x_ptr, words, w_mask, WIDE_X)
        xs1 = xs0
        xs2 = xs0
        xs3 = xs0
        if M > 1:
            xs1 = _x_columns(x_ptr + stride_xm, words, w_mask, WIDE_X)
        if M > 2:
            xs2 = _x_columns(x_ptr + 2 * stride_xm, words, w_mask, WIDE_X)
        if M > 3:
            xs3 = _x_columns(x_ptr + 3 * stride_xm, words, w_mask, WIDE_X)
        acc0 = _row_step(
            qw_ptr, s_ptr, z_ptr, n0, N, words, w_mask, groups, g_mask, stride_qn, stride_sn,
            stride_zn, xs0, xs1, xs2, xs3, acc0, M, EVEN,
        )  # fmt: skip
        if BLOCK_N > 1:
            acc1 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 1, N, words, w_mask, groups, g_mask, stride_qn,
                stride_sn, stride_zn, xs0, xs1, xs2, xs3, acc1, M, EVEN,
            )  # fmt: skip
        if BLOCK_N > 2:
            acc2 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 2, N, words, w_mask, groups, g_mask, stride_qn,
                stride_sn, stride_zn, xs0, xs1, xs2, xs3, acc2, M, EVEN,
            )  # fmt: skip
            acc3 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 3, N, words, w_mask, groups, g_mask, stride_qn,
                stride_sn, stride_zn, xs0, xs1, xs2, xs3, acc3, M, EVEN,
            )  # fmt: skip
        if BLOCK_N > 4:
            acc4 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 4, N, words, w_mask, groups, g_mask, stride_qn,
                stride_sn, stride_zn, xs0, xs1, xs2, xs3, acc4, M, EVEN,
            )  # fmt: skip
            acc5 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 5, N, words, w_mask, groups, g_mask, stride_qn,
                stride_sn, stride_zn, xs0, xs1, xs2, xs3, acc5, M, EVEN,
            )  # fmt: skip
            acc6 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 6, N, words, w_mask, groups, g_mask, stride_qn,
                stride_sn, stride_zn, xs0, xs1, xs2, xs3, acc6, M, EVEN,
            )  # fmt: skip
            acc7 = _row_step(
                qw_ptr, s_ptr, z_ptr, n0 + 7, N, words, w_mask, groups, g_mask, stride_qn,
                stride_sn, stride_zn, xs0, xs1, xs2, xs3, acc7, M, EVEN,
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
    if perm is not None:  # act-order: x's columns in the weight's order, once (gather_cols.py)
        x = gather_columns(x, perm)
    even = n % block_n == 0 and (k // PACK) % (block_k // PACK) == 0
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        qweight,
        scales,
        zeros,
        out,
        n,
        k // PACK,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        M=m,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_W=block_k // PACK,
        V=min(WORDS_PER_THREAD, block_k // PACK, group_size // PACK),
        EVEN=even,
        WIDE_X=even and x.element_size() == 2 and x.data_ptr() % 8 == 0 and x.stride(0) % 4 == 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out
