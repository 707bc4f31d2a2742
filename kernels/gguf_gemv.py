"""Decode's skinny matmul over GGUF blocks: out[m, n] = x[m, :] . W[n, :], W dequantised on the fly.

Batch-1 decode is bound by reading the weights, so the weight is read as the blocks it is
stored in (Q4_K: 4.5 bits a weight, not 16) and expanded only in registers. At 4.5 bits a
weight an H200 (4.25 TB/s) streams 7.5 * 10^12 weights a second, and its 132 SMs issue about
4.4 instructions per weight in that time, for everything: the kernel is built around that
budget (about 3.3 per weight at one row of x for Q4_K, 5.2 Q8_0, 6 Q6_K, compiled for sm90).

- No conversions: a weight's bits q are written into the low mantissa of a float whose
  exponent makes it 128 + q exactly (bits 16.. of 0x43000000 = 128.0, kernel argument MAGIC
  so that the compiler keeps it in a register). On a GPU one byte permute (libdevice
  byte_perm) places a byte there; a fused multiply-add then takes x * (128 + q). The offset
  and the block's scales are applied once per scale group, to the group's sums:

      sum_i x_i (d q_i - m) = d * (sum_i x_i (128 + q_i) - 128 sum_i x_i) - m sum_i x_i

  so the per-weight cost is about one permute (or a shift and a mask, and a mask shared by
  four weights) and one FMA, for every row of x sharing the decoded weight.
- Coalesced loads, x loaded once: a row's bytes are read by consecutive threads, and each
  thread keeps all BLOCK_N rows of its columns in registers, so each column of x is loaded
  and converted once per program (rows, not threads, share it). The sums stay per thread
  (a 2D partial per row and block) and are reduced once, after the K loop.
- Per type (see the *_rows functions): Q4_K super-blocks are 16-byte aligned and read as
  4-byte words; their 8 per-chunk sums go through shared memory to one thread per row and
  super-block, which unpacks the 6-bit scales once. Q8_0 (34 bytes) and Q6_K (210 bytes)
  blocks are only 2-byte aligned, so they are read as halfwords, a few threads per block or
  per run of 16 weights, each thread holding several halfwords of its block so that the
  block's scale is applied once to its sum.

Grid: (cdiv(N, BLOCK_N),); program p computes out[:, p * BLOCK_N : (p + 1) * BLOCK_N] for every
row of x, walking K BLOCKS blocks at a time (fewer threads than the K of a step leave some
to repeat), accumulating in fp32 and rounding once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from kernels._checks import (
    FLOAT_DTYPES,
    INTERPRETER_BLOCK_N,
    check_device,
    check_launch,
    check_tensor,
    interpreting,
    next_pow2,
)
from kernels.gemv import MAX_M, store_rows
from kernels.gguf_blocks import check_blocks, dequantize_ref
from kernels.pdl import pdl_launch, pdl_prologue

_Q8_0: tl.constexpr = tl.constexpr(8)
_Q4_K: tl.constexpr = tl.constexpr(12)
_Q6_K: tl.constexpr = tl.constexpr(14)
MAGIC = 0x43000000  # the bits of 128.0: bits 16..22 of its mantissa count 1, 2, 4, ...


@triton.jit
def _split4(t):
    """The four slices of t [..., 4] along its last axis (rank 2 to 5)."""
    if len(t.shape) == 2:
        r = tl.reshape(t, [t.shape[0], 2, 2])
    elif len(t.shape) == 3:
        r = tl.reshape(t, [t.shape[0], t.shape[1], 2, 2])
    elif len(t.shape) == 4:
        r = tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], 2, 2])
    else:
        tl.static_assert(len(t.shape) == 5)
        r = tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], t.shape[3], 2, 2])
    a, b = tl.split(r)  # even, odd
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _bytes_f(w, MAGIC, FAST: tl.constexpr):
    """128 + each byte of int32 w, as four fp32, for bytes below 128 (a top bit would land in
    the exponent): on a GPU one byte permute each, [0, 0, byte k, 0x43]."""
    if FAST:
        b0 = libdevice.byte_perm(w, MAGIC, 0x7044)
        b1 = libdevice.byte_perm(w, MAGIC, 0x7144)
        b2 = libdevice.byte_perm(w, MAGIC, 0x7244)
        b3 = libdevice.byte_perm(w, MAGIC, 0x7344)
    else:
        b0 = ((w << 16) & 0xFF0000) | MAGIC
        b1 = ((w << 8) & 0xFF0000) | MAGIC
        b2 = (w & 0xFF0000) | MAGIC
        b3 = ((w >> 8) & 0xFF0000) | MAGIC
    f = tl.float32
    return (
        b0.to(f, bitcast=True),
        b1.to(f, bitcast=True),
        b2.to(f, bitcast=True),
        b3.to(f, bitcast=True),
    )


@triton.jit
def _bytes_i(v):
    """The four bytes of int32 v, as fp32."""
    f = tl.float32
    return (
        (v & 0xFF).to(f),
        ((v >> 8) & 0xFF).to(f),
        ((v >> 16) & 0xFF).to(f),
        ((v >> 24) & 0xFF).to(f),
    )


@triton.jit
def _x_slices(x_ptr, stride_xm, at, mask, M: tl.constexpr, QTYPE: tl.constexpr):
    """For each row m < M of x (later rows repeat row 0, unused): x at `at`, as QTYPE's slicer
    returns it: (slices in the order of a thread's weights, sums of x for the offsets)."""
    x0 = _x_row(x_ptr, at, mask, QTYPE)
    x1 = x0
    x2 = x0
    x3 = x0
    if M > 1:
        x1 = _x_row(x_ptr + stride_xm, at, mask, QTYPE)
    if M > 2:
        x2 = _x_row(x_ptr + 2 * stride_xm, at, mask, QTYPE)
    if M > 3:
        x3 = _x_row(x_ptr + 3 * stride_xm, at, mask, QTYPE)
    return x0, x1, x2, x3


@triton.jit
def _x_row(xm_ptr, at, mask, QTYPE: tl.constexpr):
    x = tl.load(xm_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if QTYPE == _Q4_K:
        s = _q4_k_x(x)
    elif QTYPE == _Q6_K:
        s = _q6_k_x(x)
    else:
        s = _q8_0_x(x)
    return s


@triton.jit
def _dot_rows(f, xs, AT: tl.constexpr, t, M: tl.constexpr):
    """t[m] + sum_i f[i] * xs[m][0][AT + i] for the rows m < M of x: f, a tuple of a thread's
    weight floats, shared by the rows."""
    t0, t1, t2, t3 = t
    for i in tl.static_range(len(f)):
        t0 = tl.fma(f[i], xs[0][0][AT + i], t0)
        if M > 1:
            t1 = tl.fma(f[i], xs[1][0][AT + i], t1)
        if M > 2:
            t2 = tl.fma(f[i], xs[2][0][AT + i], t2)
        if M > 3:
            t3 = tl.fma(f[i], xs[3][0][AT + i], t3)
    return t0, t1, t2, t3


# ---------------------------------------------------------------------------------------- Q4_K


@triton.jit
def _q4_k_x(x):
    """x [SB, 8, 16] (16 = 4 e + b: byte b of word e of a half chunk) -> the 16 slices
    [1, SB, 8] by (e, b), and the sums [SB, 8] of each 16."""
    SB: tl.constexpr = x.shape[0]
    e0, e1, e2, e3 = _split4(tl.permute(tl.reshape(x, [1, SB, 8, 4, 4]), [0, 1, 2, 4, 3]))
    return _split4(e0) + _split4(e1) + _split4(e2) + _split4(e3), tl.sum(x, axis=2)


@triton.jit
def _q4_k_chunks(t):
    """[A, B, 8] sums by half chunk -> the four chunk sums [A, B]."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 4, 2]))
    return _split4(a + b)


@triton.jit
def _q4_k_block(lo, hi, xs_lo, xs_hi, d, dmin, sc, mn):
    """One row of x against each super-block [BN, SB]: sub-block j's sum is d * sc_j *
    (t_j - 128 s_j) - dmin * mn_j * s_j (t: sums of x * (128 + q) by half chunk, s: sums
    of x)."""
    u0, u2, u4, u6 = _q4_k_chunks(lo)
    u1, u3, u5, u7 = _q4_k_chunks(hi)
    x0, x2, x4, x6 = _q4_k_chunks(xs_lo[1][None])
    x1, x3, x5, x7 = _q4_k_chunks(xs_hi[1][None])
    u = (u0, u1, u2, u3, u4, u5, u6, u7)
    x = (x0, x1, x2, x3, x4, x5, x6, x7)
    t = sc[0] * (u0 - 128.0 * x0)
    m = mn[0] * x0
    for j in tl.static_range(1, 8):
        t = tl.fma(sc[j], u[j] - 128.0 * x[j], t)
        m = tl.fma(mn[j], x[j], m)
    return d * t - dmin * m


@triton.jit
def _q4_k_rows(
    x_ptr, stride_xm, w_ptr, row, stride_wn, NUM_BLOCKS, MAGIC, M: tl.constexpr,
    BLOCK_N: tl.constexpr, SB: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Q4_K: 144-byte super-blocks (d, dmin, 12 bytes of packed 6-bit scales and mins, 128
    bytes of nibbles: byte i of chunk c holds weights 64 c + i (low nibble, sub-block 2 c)
    and 64 c + 32 + i (high, 2 c + 1)). Rows and blocks are whole 4-byte words: a thread
    loads 4 words (16 bytes, half a chunk) of each row, and 8 threads cover a super-block;
    the sums by half chunk go to one thread per row and super-block, which unpacks the
    scales and mins once."""
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    rows = row.to(tl.int64) * (stride_wn // 4)  # [BLOCK_N] word offsets
    c2 = tl.arange(0, 8)  # half chunk: bytes 16 c2 ... 16 c2 + 15 of the nibbles
    e = tl.arange(0, 4)
    i16 = tl.arange(0, 16)
    zero = tl.zeros([BLOCK_N, SB], dtype=tl.float32)
    acc = (zero, zero, zero, zero)
    for b0 in range(0, NUM_BLOCKS, SB):
        blk = b0 + tl.arange(0, SB)
        # blocks past the row's end read its last block again, against x of zeros
        at = rows[:, None] + (tl.minimum(blk, NUM_BLOCKS - 1) * 36)[None, :]
        h0 = tl.load(w32 + at)
        d = (h0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (h0 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        s0 = tl.load(w32 + at + 1)
        s1 = tl.load(w32 + at + 2)
        s2 = tl.load(w32 + at + 3)
        # the 6-bit scales and mins, four to a word: sub-blocks 0-3 whole in bytes 0-7,
        # 4-7 with low bits in bytes 8-11 and top bits in the spare top bits of bytes 0-7
        sc = _bytes_i(s0 & 0x3F3F3F3F) + _bytes_i((s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030))
        mn = _bytes_i(s1 & 0x3F3F3F3F) + _bytes_i(
            ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030)
        )
        q = tl.load(w32 + at[:, :, None, None] + 4 + (4 * c2)[None, None, :, None] + e)
        words = _split4(q)  # [BN, SB, 8] each: word e of each half chunk
        x_at = (blk * 256)[:, None, None] + (c2 // 2 * 64 + c2 % 2 * 16)[None, :, None] + i16
        x_mask = (blk < NUM_BLOCKS)[:, None, None]
        lo = _x_slices(x_ptr, stride_xm, x_at, x_mask, M, _Q4_K)  # the low nibbles' x
        hi = _x_slices(x_ptr, stride_xm, x_at + 32, x_mask, M, _Q4_K)
        z = tl.zeros(words[0].shape, tl.float32)
        t_lo = (z, z, z, z)
        t_hi = (z, z, z, z)
        for j in tl.static_range(4):
            f = _bytes_f(words[j] & 0x0F0F0F0F, MAGIC, FAST)
            t_lo = _dot_rows(f, lo, 4 * j, t_lo, M)
            f = _bytes_f((words[j] >> 4) & 0x0F0F0F0F, MAGIC, FAST)
            t_hi = _dot_rows(f, hi, 4 * j, t_hi, M)
        acc0, acc1, acc2, acc3 = acc
        acc0 += _q4_k_block(t_lo[0], t_hi[0], lo[0], hi[0], d, dmin, sc, mn)
        if M > 1:
            acc1 += _q4_k_block(t_lo[1], t_hi[1], lo[1], hi[1], d, dmin, sc, mn)
        if M > 2:
            acc2 += _q4_k_block(t_lo[2], t_hi[2], lo[2], hi[2], d, dmin, sc, mn)
        if M > 3:
            acc3 += _q4_k_block(t_lo[3], t_hi[3], lo[3], hi[3], d, dmin, sc, mn)
        acc = (acc0, acc1, acc2, acc3)
    return _row_sums(acc)


@triton.jit
def _row_sums(acc):
    """Each of the four accumulators (rows of x) [BLOCK_N, ...] summed to [BLOCK_N]."""
    return _row_sum(acc[0]), _row_sum(acc[1]), _row_sum(acc[2]), _row_sum(acc[3])


@triton.jit
def _row_sum(a):
    if len(a.shape) == 4:
        a = tl.sum(a, axis=3)
    if len(a.shape) == 3:
        a = tl.sum(a, axis=2)
    return tl.sum(a, axis=1)


# ---------------------------------------------------------------------------------------- Q6_K


@triton.jit
def _q6_k_x(x):
    """x [S, u, t, 16] (16 = 8 k + 2 r + b) -> the 16 slices [1, S, u, r] in the order of a
    thread's weights, 4 t + 2 k + b, and the four sums over (k, b), by t."""
    S: tl.constexpr = x.shape[0]
    x = tl.reshape(x, [S, 4, 4, 2, 4, 2])  # [S, u, t, k, r, b]
    x = tl.reshape(tl.permute(x, [0, 1, 4, 2, 3, 5]), [1, S, 4, 4, 8, 2])  # [1, S, u, r, (t, k), b]
    xb0, xb1 = tl.split(x)
    x00, x01 = tl.split(tl.reshape(xb0, [1, S, 4, 4, 4, 2]))  # [1, S, u, r, t] by k
    x10, x11 = tl.split(tl.reshape(xb1, [1, S, 4, 4, 4, 2]))
    p00 = _split4(x00)  # by t: (k, b) = (0, 0)
    p01 = _split4(x10)  # (0, 1)
    p10 = _split4(x01)  # (1, 0)
    p11 = _split4(x11)  # (1, 1)
    xs = (
        p00[0], p01[0], p10[0], p11[0], p00[1], p01[1], p10[1], p11[1],
        p00[2], p01[2], p10[2], p11[2], p00[3], p01[3], p10[3], p11[3],
    )  # fmt: skip
    sums = (
        (p00[0] + p01[0]) + (p10[0] + p11[0]),
        (p00[1] + p01[1]) + (p10[1] + p11[1]),
        (p00[2] + p01[2]) + (p10[2] + p11[2]),
        (p00[3] + p01[3]) + (p10[3] + p11[3]),
    )
    return xs, sums


@triton.jit
def _q6_k_rows(
    x_ptr, stride_xm, w_ptr, row, stride_wn, NUM_BLOCKS, MAGIC, M: tl.constexpr,
    BLOCK_N: tl.constexpr, S: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Q6_K: 210-byte super-blocks (only 2-byte aligned): weight 128 h + 32 t + i (half h,
    i < 32) has its low 4 bits in nibble t // 2 of ql[64 h + 32 (t % 2) + i], its top 2 in
    bits 2 t of qh[32 h + i], and the int8 scale of its 16: 8 h + 2 t + i // 16. A run of
    16 i (u: h and i // 16; one scale per t) of ql and qh is read by 4 threads, thread r
    taking halfwords r and r + 4 (bytes 2 r, 2 r + 1, 2 r + 8, 2 r + 9; each load covers 8
    consecutive bytes of the run): it builds the 6-bit values four to a word and holds 16
    weights of 4 scales for each row of the run, and reads those scales itself."""
    w16 = w_ptr.to(tl.pointer_type(tl.uint16))
    rows = row.to(tl.int64) * (stride_wn // 2)  # [BLOCK_N] halfword offsets
    k = tl.arange(0, 2)[:, None, None, None, None]
    u = tl.arange(0, 4)  # run: half u // 2, i from 16 (u % 2)
    r = tl.arange(0, 4)
    ql_at = (u // 2 * 32 + u % 2 * 8)[:, None] + 4 * k + r  # [k, 1, 1, u, r]
    qh_at = (u // 2 * 16 + u % 2 * 8)[:, None] + 4 * k + r
    x_u = (u // 2 * 128 + u % 2 * 16)[None, :, None, None]
    x_t = (32 * tl.arange(0, 4))[None, None, :, None]
    zero = tl.zeros([BLOCK_N, S, 4, 4], dtype=tl.float32)
    acc = (zero, zero, zero, zero)
    for b0 in range(0, NUM_BLOCKS, S):
        blk = b0 + tl.arange(0, S)
        at = rows[:, None] + (tl.minimum(blk, NUM_BLOCKS - 1) * 105)[None, :]  # [BN, S]
        d = tl.load(w16 + at + 104).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None, None]
        # [k, BN, S, u, r] halfwords -> words of bytes 2 r, 2 r + 1, 2 r + 8, 2 r + 9 of a run
        at5 = at[None, :, :, None, None]
        a0, a1 = tl.split(tl.permute(tl.load(w16 + at5 + ql_at).to(tl.int32), [1, 2, 3, 4, 0]))
        b0_, b1_ = tl.split(
            tl.permute(tl.load(w16 + at5 + 16 + ql_at).to(tl.int32), [1, 2, 3, 4, 0])
        )
        h0, h1 = tl.split(tl.permute(tl.load(w16 + at5 + 64 + qh_at).to(tl.int32), [1, 2, 3, 4, 0]))
        wa = a0 | (a1 << 16)
        wb = b0_ | (b1_ << 16)
        wh = h0 | (h1 << 16)
        # the four 6-bit values of each t, a byte each (t: ql nibble t // 2 of run t % 2)
        q = (
            (wa & 0x0F0F0F0F) | ((wh << 4) & 0x30303030),
            (wb & 0x0F0F0F0F) | ((wh << 2) & 0x30303030),
            ((wa >> 4) & 0x0F0F0F0F) | (wh & 0x30303030),
            ((wb >> 4) & 0x0F0F0F0F) | ((wh >> 2) & 0x30303030),
        )
        # the run's scale of each t (byte 192 + 8 h + 2 t + i // 16), read by each of its
        # threads, laid out as the weights (one moved to them would cost more)
        sc_at = at[:, :, None, None] + 96 + (u // 2 * 4)[:, None] + r * 0
        sc_ptr = (w16 + sc_at).to(tl.pointer_type(tl.int8)) + (u % 2)[:, None]
        sc = (
            tl.load(sc_ptr).to(tl.float32),
            tl.load(sc_ptr + 2).to(tl.float32),
            tl.load(sc_ptr + 4).to(tl.float32),
            tl.load(sc_ptr + 6).to(tl.float32),
        )
        x_at = (blk * 256)[:, None, None, None] + x_u + x_t + tl.arange(0, 16)
        xs = _x_slices(x_ptr, stride_xm, x_at, (blk < NUM_BLOCKS)[:, None, None, None], M, _Q6_K)
        v = (zero, zero, zero, zero)
        for t in tl.static_range(4):
            ut = _dot_rows(_bytes_f(q[t], MAGIC, FAST), xs, 4 * t, (zero, zero, zero, zero), M)
            v = _q6_k_scale(v, ut, sc[t], xs, t, M)
        acc0, acc1, acc2, acc3 = acc
        acc = (
            tl.fma(d, v[0], acc0),
            tl.fma(d, v[1], acc1),
            tl.fma(d, v[2], acc2),
            tl.fma(d, v[3], acc3),
        )
    return _row_sums(acc)


@triton.jit
def _q6_k_scale(v, u, sc, xs, T: tl.constexpr, M: tl.constexpr):
    """v[m] + sc * (u[m] - 160 * (sum of x over t = T's weights)): the 6-bit values' offset
    (128 from the float trick, 32 of Q6_K) taken off per scale."""
    v0, v1, v2, v3 = v
    v0 = tl.fma(sc, u[0] - 160.0 * xs[0][1][T], v0)
    if M > 1:
        v1 = tl.fma(sc, u[1] - 160.0 * xs[1][1][T], v1)
    if M > 2:
        v2 = tl.fma(sc, u[2] - 160.0 * xs[2][1][T], v2)
    if M > 3:
        v3 = tl.fma(sc, u[3] - 160.0 * xs[3][1][T], v3)
    return v0, v1, v2, v3


# ---------------------------------------------------------------------------------------- Q8_0


@triton.jit
def _i8_f(w, K: tl.constexpr, MAGIC):
    """384 + the signed byte K of int32 w, as fp32: the byte, its sign bit flipped (q + 128),
    goes to bits 15..22 of 256.0 (bits 0x43800000)."""
    v = w >> (8 * K - 15) if K >= 2 else w << (15 - 8 * K)
    return ((v & 0x7F8000) ^ (MAGIC | 0xC00000)).to(tl.float32, bitcast=True)


@triton.jit
def _q8_0_x(x):
    """x [G, k, 8] (k: a block's quarters, 8 = 2 r + b) -> the 8 slices [1, G, r] in the
    order of a thread's weights (k, b), and their sum."""
    G: tl.constexpr = x.shape[0]
    x = tl.permute(tl.reshape(x, [1, G, 4, 4, 2]), [0, 1, 3, 2, 4])  # [1, G, r, k, b]
    lo, hi = tl.split(x)  # b = 0, 1
    x0, x2, x4, x6 = _split4(lo)
    x1, x3, x5, x7 = _split4(hi)
    # the sum from the slices, in the weights' layout (a sum of x here would be laid out as
    # x and would drag the products' sums across to it)
    return (x0, x1, x2, x3, x4, x5, x6, x7), ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))


@triton.jit
def _q8_0_rows(
    x_ptr, stride_xm, w_ptr, row, stride_wn, NUM_BLOCKS, MAGIC, M: tl.constexpr,
    BLOCK_N: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """Q8_0: 34-byte blocks (fp16 d, 32 int8), so only 2-byte aligned: each block's 16
    halfwords of weights are read by 4 threads, thread r taking halfwords r, r + 4, r + 8,
    r + 12 (four loads that each cover 8 consecutive bytes of the block with 4 threads), so
    a thread holds 8 weights of a block and applies d once to their sum."""
    w16 = w_ptr.to(tl.pointer_type(tl.uint16))
    rows = row.to(tl.int64) * (stride_wn // 2)  # [BLOCK_N] halfword offsets
    k = tl.arange(0, 4)
    r = tl.arange(0, 4)
    zero = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
    acc = (zero, zero, zero, zero)
    for b0 in range(0, NUM_BLOCKS, G):
        blk = b0 + tl.arange(0, G)
        at = rows[:, None] + (tl.minimum(blk, NUM_BLOCKS - 1) * 17)[None, :]  # [BN, G]
        d = tl.load(w16 + at).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
        # [k, BN, G, r]: halfword 4 k + r of each block's weights, k in each thread's registers
        hw = tl.load(w16 + at[None, :, :, None] + 1 + (4 * k)[:, None, None, None] + r)
        h = _split4(tl.permute(hw.to(tl.int32), [1, 2, 3, 0]))  # weights 8 k + 2 r (+ 1)
        x_at = (blk * 32)[:, None, None] + (8 * k)[None, :, None] + tl.arange(0, 8)
        xs = _x_slices(x_ptr, stride_xm, x_at, (blk < NUM_BLOCKS)[:, None, None], M, _Q8_0)
        t = (zero, zero, zero, zero)
        for i in tl.static_range(4):
            t = _dot_rows((_i8_f(h[i], 0, MAGIC), _i8_f(h[i], 1, MAGIC)), xs, 2 * i, t, M)
        acc0, acc1, acc2, acc3 = acc
        acc0 += d * (t[0] - 384.0 * xs[0][1])
        if M > 1:
            acc1 += d * (t[1] - 384.0 * xs[1][1])
        if M > 2:
            acc2 += d * (t[2] - 384.0 * xs[2][1])
        if M > 3:
            acc3 += d * (t[3] - 384.0 * xs[3][1])
        acc = (acc0, acc1, acc2, acc3)
    return _row_sums(acc)


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    NUM_BLOCKS,
    stride_xm,
    stride_wn,
    stride_om,
    MAGIC,
    M: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    FAST: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    row = tl.minimum(offs_n, N - 1)  # rows past N read row N - 1 and are never stored
    if QTYPE == _Q4_K:
        r0, r1, r2, r3 = _q4_k_rows(
            x_ptr, stride_xm, w_ptr, row, stride_wn, NUM_BLOCKS, MAGIC, M, BLOCK_N, BLOCKS, FAST
        )
    elif QTYPE == _Q6_K:
        r0, r1, r2, r3 = _q6_k_rows(
            x_ptr, stride_xm, w_ptr, row, stride_wn, NUM_BLOCKS, MAGIC, M, BLOCK_N, BLOCKS, FAST
        )
    else:
        tl.static_assert(QTYPE == _Q8_0)
        r0, r1, r2, r3 = _q8_0_rows(
            x_ptr, stride_xm, w_ptr, row, stride_wn, NUM_BLOCKS, MAGIC, M, BLOCK_N, BLOCKS
        )
    store_rows(out_ptr, stride_om, offs_n, n_mask, r0, r1, r2, r3, M)


# (block_n, block_k, num_warps) when not given: each type's step covers every thread of 4
# warps once (Q4_K 8 threads a super-block, Q6_K 16, Q8_0 4 a block)
DEFAULTS = {"Q4_K": (16, 4096, 4), "Q6_K": (8, 2048, 4), "Q8_0": (8, 1024, 4)}


def gguf_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    *,
    qtype: str,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 1,
) -> torch.Tensor:
    """x @ W.T for at most MAX_M rows of x, W given as GGUF blocks of `qtype`; returns out.

    x: [m, k] (any row stride, m <= MAX_M), a float dtype; blocks: uint8 [n, row bytes]
    (kernels/gguf_blocks.py; Q4_K's at a 4-byte aligned address and row stride). out
    (optional, written): [m, n] of x's dtype, any row stride. block_n: rows per program;
    block_k: weights per step, whole blocks (powers of two; block_k below one block reads one,
    past the row's blocks' power of two reads that many); None: DEFAULTS. num_stages: passed
    to Triton (the loads are not software-pipelined).
    """
    op = "gguf_gemv"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1 to {MAX_M} rows, got {m}")
    lay = check_blocks(op, blocks, qtype, k, device=x.device)
    if qtype == "Q4_K" and (
        blocks.data_ptr() % 4 or (blocks.shape[0] > 1 and blocks.stride(0) % 4)
    ):
        raise ValueError(
            f"{op}: Q4_K blocks are read as 4-byte words: their address and row stride "
            "must be multiples of 4"
        )
    n = blocks.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    dn, dk, dw = DEFAULTS[qtype]
    if block_n is None:
        block_n = INTERPRETER_BLOCK_N if interpreting() else dn
    block_k = dk if block_k is None else block_k
    num_warps = dw if num_warps is None else num_warps
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {size}")
    check_launch(op, num_warps, num_stages)
    if n == 0:
        return out
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        blocks,
        out,
        n,
        k // lay.elems,
        x.stride(0),
        blocks.stride(0),
        out.stride(0),
        MAGIC,
        M=m,
        QTYPE=lay.type_id,
        BLOCK_N=block_n,
        # a step never longer than the row: past it, every thread would be masked
        BLOCKS=min(max(1, block_k // lay.elems), next_pow2(k // lay.elems)),
        FAST=not interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(x.device),
    )
    return out


def gguf_gemv_ref(x: torch.Tensor, blocks: torch.Tensor, *, qtype: str) -> torch.Tensor:
    """The torch twin of `gguf_gemv` (and of gguf_matmul): the weights dequantised in fp32,
    fp32 products and sums, rounded once to x's dtype."""
    return (x.float() @ dequantize_ref(blocks, qtype).T).to(x.dtype)
