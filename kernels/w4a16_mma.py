# The @triton.jit code grows tuples of tensors from () by concatenation (Triton's compiler
# takes no starred tuples or annotated tuples), which mypy reads as changing their type (and
# a tuple grown in a loop as too short to index).
# mypy: disable-error-code="assignment,var-annotated,misc"
"""int4 matmul for decode on the tensor cores' warp-level MMA: out = x @ w.T for 1 to 64 rows
of 16-bit x, w int4 in a layout shuffled for the MMA's fragments (`shuffle_w4`), which a GPU
keeps in place of kernels/w4a16.py's plain one.

kernels/w4a16_gemv.py spends about three instructions a weight per row of x (an AND, a
multiply-add, the rest overhead): its large projections issue in most cycles with the DRAM
far from busy, and every further row of x costs another multiply-add a weight. Here one
`mma.sync.m16n8k16` takes 256 weights (16 weight rows x 16 columns) against a tile of 8 rows
of x (up to 8 tiles, NB, each step's A fragment shared by their MMAs), and the weights reach
it with 7 integer instructions:

- `shuffle_w4` (at load) stores each tile of 16 weight rows so that lane l's 32-bit word for
  a step holds exactly the 8 nibbles of its A fragment, arranged so that `(w >> 4i) &
  0x000F000F | OFF` (a shift and a LOP3) is the fragment's register i: two 16-bit floats OFF +
  q, exact (OFF = 128 in bf16, 1024 in fp16); a thread's 4 words of 4 steps are one 16-byte
  load;
- a step's 16 columns are chosen so that a lane's x operands for the 4 steps of a 64-column
  chunk are 16 consecutive columns of x (two 16-byte loads): the MMA sums over k in any order
  as long as A and B agree on it;
- the zero point and the offset never meet the weights: sum_k s (q_k - z) x_k = s (sum_k
  (OFF + q_k) x_k - (OFF + z) sum_k x_k), sum_k x_k coming from a second MMA of the same x
  against ones; the scale multiplies each group's sums once. Or the A fragments take the
  zero points off themselves (one fma.rn a register, q - z exact), one MMA a tile and step
  (`_chunk_sums`; a launch argument, by default `zsub_default`: for every tile count of x
  but 2 tiles in small grids).

A CTA's SPLIT warps share one tile and split K, each a run of whole groups, their fp32 sums
added in a fixed order at the end (the same bits every call). Each chunk's words are loaded
AHEAD chunks before they are multiplied: a warp's run is otherwise a chain of dependent round
trips to memory. The rows of x past M are read as row M - 1, unmasked (their sums are not
stored). Launch defaults (warps a tile, chunks ahead, where the zero points come off) by row
count and grid: `mma_split`, `mma_ahead`, `zsub_default`.

Measured on an H200 (Llama-3.1-8B's four projections, cold weights in a CUDA graph,
loadtest/results/gpu_w4a16_mma_h200_run5.json, µs, the best launch each): one row of x 47.4
against 52.8 for the best GEMV launches, 4 rows 48.6 against 139.0, 8 rows 50.2 against
131.1 for kernels/w4a16_gemm; 16, 32 and 64 rows 66.3, 109.5 and 196.5 against 135.9, 166.8
and 237.5.

Groups of 32 columns with float mins (w = s q - m, GGUF's Q4_K: kernels/gguf_q4k_mma.py)
whose scales and mins are of x's 16-bit type take the scales inside A instead (`SM`,
`_chunk_sums_sm`): register i is fma((w >> 4i) & 0x000F000F | OFF, s, -OFF s), that is s q
rounded once to x's type (a relative 2^-9 of s q in bf16, as a bf16 weight's own
rounding), and a second MMA of A = -m against the same x adds the mins' terms; nothing is
folded per group and no MMA against ones runs, and a loop body takes two chunks (four
groups). Folding each group's sums instead took 106.5 µs for the four projections at one row
of x against 65.3 this way (47.2 for AWQ's groups of 128, `gpu_w4a16_sm_h200_run1.json`).

The MMAs are inline PTX; under the Triton interpreter (no PTX) the same sums are computed
from the shuffled words by tensor operations in fp32 (`EMULATE`), which checks the layout's
meaning but not the registers.

Grid: (N / 16,), SPLIT warps a program.

The words are converted at load (`shuffle_w4`); `unshuffle_w4` gives the plain layout back
for the torch twin, and kernels/w4a16_mma_dequant.py expands them for prefill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor, interpreting, next_pow2, sm_count
from kernels.f16x2 import split4
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16 import PACK, SCALE_DTYPES, pack_int4, unpack_int4

TILE_N = 16  # weight rows a tile: the MMA's M
CHUNK = 64  # columns a thread's 16-byte load of 4 words covers: 4 steps of K = 16
NB_MAX = 8  # tiles of 8 rows of x
MAX_M = 8 * NB_MAX  # rows of x
AHEAD = 2  # chunks of words in flight ahead of the one multiplied, by default (`mma_ahead`)
G32 = 32  # groups of 32 columns: a layout of their own (`shuffle_w4`), two groups a chunk


def shuffle_w4(qweight: torch.Tensor, group_size: int = CHUNK) -> torch.Tensor:
    """The plain layout's int32 [N, K / 8] words (kernels/w4a16.py) -> int32 [N / 16, K / 64,
    32, 4]: tile t, chunk c, lane l = 4 g + p, step v. Bits 4j..4j+3 of that word (j = 4 e +
    2 h + r) hold the weight of row 16 t + g + 8 r and column 64 c + 16 p + 4 v + 2 h + e.
    For groups of 32 columns (`group_size` 32) each step's columns lie in one group instead:
    column 64 c + 32 (v // 2) + 8 p + 4 (v % 2) + 2 h + e, steps 0-1 the chunk's first group
    and 2-3 its second (`_x_pairs` reads x to match). Converted a slice of rows at a time (a
    few bytes a weight of scratch)."""
    n, words = qweight.shape
    k = words * PACK
    if n % TILE_N or k % CHUNK:
        raise ValueError(
            f"shuffle_w4: N must be a multiple of {TILE_N} and K of {CHUNK}, got {n} and {k}"
        )
    out = torch.empty((n // TILE_N, k // CHUNK, 32, 4), dtype=torch.int32, device=qweight.device)
    shifts = torch.arange(0, 4 * PACK, 4, device=qweight.device, dtype=torch.int64)
    step = max(TILE_N, (2**21 // max(k, 1)) // TILE_N * TILE_N)
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        q = unpack_int4(qweight[r0 : r0 + rows]).to(torch.int64)  # [rows, K]
        if group_size == G32:
            #           t                r  g  c           vh p  vl h  e
            q = q.view(rows // TILE_N, 2, 8, k // CHUNK, 2, 4, 2, 2, 2)
            q = q.permute(0, 3, 2, 5, 4, 6, 8, 7, 1)  # t c g p vh vl e h r
        else:
            #           t                r  g  c           p  v  h  e
            q = q.view(rows // TILE_N, 2, 8, k // CHUNK, 4, 4, 2, 2)
            q = q.permute(0, 3, 2, 4, 5, 7, 6, 1)  # t c g p v e h r: nibble j = 4e + 2h + r
        q = q.reshape(rows // TILE_N, k // CHUNK, 32, 4, PACK) << shifts
        w = q.sum(dim=-1)  # 0 .. 2^32 - 1, as two's complement int32 below
        out[r0 // TILE_N : (r0 + rows) // TILE_N] = torch.where(w >= 2**31, w - 2**32, w)
    return out


def unshuffle_w4(qmma: torch.Tensor, group_size: int = CHUNK) -> torch.Tensor:
    """The inverse of `shuffle_w4`: int32 [N / 16, K / 64, 32, 4] -> the plain layout's int32
    [N, K / 8] (for the torch twin and reference products; a slice of tiles at a time)."""
    tiles, chunks = qmma.shape[:2]
    k = chunks * CHUNK
    out = torch.empty((tiles * TILE_N, k // PACK), dtype=torch.int32, device=qmma.device)
    shifts = torch.arange(0, 4 * PACK, 4, device=qmma.device, dtype=torch.int32)
    step = max(1, 2**17 // max(chunks, 1))
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        q = (qmma[t0:t1, ..., None] >> shifts) & 0xF  # t c (g p) v (e h r)
        if group_size == G32:
            q = q.view(t1 - t0, chunks, 8, 4, 2, 2, 2, 2, 2)  # t c g p vh vl e h r
            q = q.permute(0, 8, 2, 1, 4, 3, 5, 7, 6)  # t r g c vh p vl h e
        else:
            q = q.view(t1 - t0, chunks, 8, 4, 4, 2, 2, 2)  # t c g p v e h r
            q = q.permute(0, 7, 2, 1, 3, 4, 6, 5)  # t r g c p v h e
        out[t0 * TILE_N : t1 * TILE_N] = pack_int4(q.reshape((t1 - t0) * TILE_N, k))
    return out


def _a_asm(off_pair: str) -> str:
    """PTX of a step's A fragment from the lane's word ($4): register i is `(w >> 4i) &
    0x000F000F | OFF` ($0..$3), two 16-bit floats OFF + q."""
    lines = ["{", ".reg .b32 t;", f"lop3.b32 $0, $4, 0x000F000F, {off_pair}, 0xEA;"]
    for i in (1, 2, 3):
        lines += [f"shr.u32 t, $4, {4 * i};", f"lop3.b32 ${i}, t, 0x000F000F, {off_pair}, 0xEA;"]
    return "\n".join([*lines, "}"])


def _mma_asm(kind: str, one_pair: str) -> str:
    """PTX of a step's two MMAs for 16-bit floats `kind`: d ($0..$3, in $8..$11) += A
    ($16..$19) @ x ($20, $21), and e ($4..$7, in $12..$15) += ones @ x."""
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    return "\n".join(
        ["{", ".reg .b32 t;", f"mov.b32 t, {one_pair};",
         f"{mma} {{$0, $1, $2, $3}}, {{$16, $17, $18, $19}}, {{$20, $21}}, {{$8, $9, $10, $11}};",
         f"{mma} {{$4, $5, $6, $7}}, {{t, t, t, t}}, {{$20, $21}}, {{$12, $13, $14, $15}};", "}"]
    )  # fmt: skip


def _az_asm(kind: str, off_pair: str, one_pair: str) -> str:
    """PTX of a step's A fragment less the zero points: register i is `(w >> 4i) & 0x000F000F
    | OFF` times one plus -(OFF + z) of its row ($5 for rows g, $6 for rows g + 8), that is
    q - z, exact."""
    lines = ["{", ".reg .b32 t, u, one;", f"mov.b32 one, {one_pair};"]
    for i in range(4):
        src = "$4" if i == 0 else "u"
        if i:
            lines.append(f"shr.u32 u, $4, {4 * i};")
        lines.append(f"lop3.b32 t, {src}, 0x000F000F, {off_pair}, 0xEA;")
        lines.append(f"fma.rn.{kind}x2 ${i}, t, one, {'$5' if i % 2 == 0 else '$6'};")
    return "\n".join([*lines, "}"])


def _as_asm(kind: str, off_pair: str) -> str:
    """PTX of a step's A fragment with the scales inside: register i is `(w >> 4i) & 0x000F000F
    | OFF` times s plus -OFF s of its row ($5, $7 for rows g; $6, $8 for rows g + 8), that is
    s q rounded once to the 16-bit type."""
    lines = ["{", ".reg .b32 t, u;"]
    for i in range(4):
        src = "$4" if i == 0 else "u"
        if i:
            lines.append(f"shr.u32 u, $4, {4 * i};")
        lines.append(f"lop3.b32 t, {src}, 0x000F000F, {off_pair}, 0xEA;")
        lo = i % 2 == 0
        lines.append(f"fma.rn.{kind}x2 ${i}, t, {'$5' if lo else '$6'}, {'$7' if lo else '$8'};")
    return "\n".join([*lines, "}"])


def _sm_pairs_asm(kind: str, neg_off_pair: str, high: bool) -> str:
    """PTX of a group's pairs from the words of two groups' scales ($6 rows g, $7 rows g + 8)
    and mins ($8, $9), the group the low or `high` half of each: (s, s) ($0, $1), (-OFF s,
    -OFF s) ($2, $3, exact: OFF a power of two) and (-m, -m) ($4, $5)."""
    sel = "0x3232" if high else "0x1010"
    return "\n".join(
        ["{", ".reg .b32 t, c, z;", f"mov.b32 c, {neg_off_pair};", "mov.b32 z, 0x80008000;",
         f"prmt.b32 $0, $6, 0, {sel};", f"prmt.b32 $1, $7, 0, {sel};",
         f"fma.rn.{kind}x2 $2, $0, c, z;", f"fma.rn.{kind}x2 $3, $1, c, z;",
         f"prmt.b32 t, $8, 0, {sel};", "xor.b32 $4, t, 0x80008000;",
         f"prmt.b32 t, $9, 0, {sel};", "xor.b32 $5, t, 0x80008000;", "}"]
    )  # fmt: skip


def _mma1_asm(kind: str) -> str:
    """PTX of one MMA: d ($0..$3, in $4..$7) += A ($8..$11) @ x ($12, $13)."""
    return (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0, $1, $2, $3}}, "
        "{$8, $9, $10, $11}, {$12, $13}, {$4, $5, $6, $7};"
    )


# OFF + q: 1024 + q in fp16 (0x6400), 128 + q in bf16 (0x4300); ones: 0x3C00, 0x3F80
_A_F16: tl.constexpr = tl.constexpr(_a_asm("0x64006400"))
_A_BF16: tl.constexpr = tl.constexpr(_a_asm("0x43004300"))
_MMA_F16: tl.constexpr = tl.constexpr(_mma_asm("f16", "0x3C003C00"))
_MMA_BF16: tl.constexpr = tl.constexpr(_mma_asm("bf16", "0x3F803F80"))
_AZ_F16: tl.constexpr = tl.constexpr(_az_asm("f16", "0x64006400", "0x3C003C00"))
_AZ_BF16: tl.constexpr = tl.constexpr(_az_asm("bf16", "0x43004300", "0x3F803F80"))
_MMA1_F16: tl.constexpr = tl.constexpr(_mma1_asm("f16"))
_MMA1_BF16: tl.constexpr = tl.constexpr(_mma1_asm("bf16"))
_AS_F16: tl.constexpr = tl.constexpr(_as_asm("f16", "0x64006400"))
_AS_BF16: tl.constexpr = tl.constexpr(_as_asm("bf16", "0x43004300"))
_SM_LO_F16: tl.constexpr = tl.constexpr(_sm_pairs_asm("f16", "0xE400E400", False))
_SM_HI_F16: tl.constexpr = tl.constexpr(_sm_pairs_asm("f16", "0xE400E400", True))
_SM_LO_BF16: tl.constexpr = tl.constexpr(_sm_pairs_asm("bf16", "0xC300C300", False))
_SM_HI_BF16: tl.constexpr = tl.constexpr(_sm_pairs_asm("bf16", "0xC300C300", True))
# -(OFF + z) in the sign and exponent bits of a 16-bit float: 0xE400 + z in fp16, 0xC300 + z
# in bf16 (exact for z up to 16)
_NEG_OFF_F16: tl.constexpr = tl.constexpr(0xE400)
_NEG_OFF_BF16: tl.constexpr = tl.constexpr(0xC300)


@triton.jit
def _a_fragment(word, FP16: tl.constexpr):
    """A step's A fragment (4 [T] registers) from the lane's word."""
    return tl.inline_asm_elementwise(
        _A_F16 if FP16 else _A_BF16, "=r,=r,=r,=r,r", [word], dtype=(tl.uint32,) * 4,
        is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _a_fragment_z(word, nz_lo, nz_hi, FP16: tl.constexpr):
    """A step's A fragment less the zero points (q - z, exact): nz_lo, nz_hi the pairs
    -(OFF + z) of rows g and g + 8 ([T] uint32)."""
    return tl.inline_asm_elementwise(
        _AZ_F16 if FP16 else _AZ_BF16, "=r,=r,=r,=r,r,r,r", [word, nz_lo, nz_hi],
        dtype=(tl.uint32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _a_fragment_s(word, pr, FP16: tl.constexpr):
    """A step's A fragment with the scales inside (s q, rounded once): pr a group's pairs
    (`_sm_pairs`)."""
    return tl.inline_asm_elementwise(
        _AS_F16 if FP16 else _AS_BF16, "=r,=r,=r,=r,r,r,r,r,r",
        [word, pr[0], pr[1], pr[2], pr[3]], dtype=(tl.uint32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _sm_pairs(s_lo, s_hi, m_lo, m_hi, HIGH: tl.constexpr, FP16: tl.constexpr):
    """A group's (s, s), (-OFF s, -OFF s) and (-m, -m) pairs for rows g and g + 8 from the
    16-bit words holding two groups' scales and mins (the group the HIGH half)."""
    return tl.inline_asm_elementwise(
        (_SM_HI_F16 if HIGH else _SM_LO_F16) if FP16 else (_SM_HI_BF16 if HIGH else _SM_LO_BF16),
        "=r,=r,=r,=r,=r,=r,r,r,r,r", [s_lo, s_hi, m_lo, m_hi], dtype=(tl.uint32,) * 6,
        is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _sm_block(s_ptr, m_ptr, row_lo, row_hi, stride_sn, stride_mn, blk, FP16: tl.constexpr):
    """The pairs (`_sm_pairs`) of a block's 4 groups of 32 columns, from one 8-byte load each
    of rows g and g + 8's scales and mins (16-bit, x's type)."""
    two = tl.arange(0, 2)[None, :]
    sp = s_ptr.to(tl.pointer_type(tl.uint32))
    mp = m_ptr.to(tl.pointer_type(tl.uint32))
    s_lo = tl.split(tl.load(sp + (row_lo * (stride_sn // 2) + 2 * blk)[:, None] + two))
    s_hi = tl.split(tl.load(sp + (row_hi * (stride_sn // 2) + 2 * blk)[:, None] + two))
    m_lo = tl.split(tl.load(mp + (row_lo * (stride_mn // 2) + 2 * blk)[:, None] + two))
    m_hi = tl.split(tl.load(mp + (row_hi * (stride_mn // 2) + 2 * blk)[:, None] + two))
    return (
        _sm_pairs(s_lo[0], s_hi[0], m_lo[0], m_hi[0], False, FP16),
        _sm_pairs(s_lo[0], s_hi[0], m_lo[0], m_hi[0], True, FP16),
        _sm_pairs(s_lo[1], s_hi[1], m_lo[1], m_hi[1], False, FP16),
        _sm_pairs(s_lo[1], s_hi[1], m_lo[1], m_hi[1], True, FP16),
    )


@triton.jit
def _chunk_sums_sm(words, xs, d, f, pr, NB: tl.constexpr, FP16: tl.constexpr,
                   F_SEP: tl.constexpr, V0: tl.constexpr):  # fmt: skip
    """d plus a group's two steps (V0, V0 + 1) of a chunk with its scale inside A (s q), and
    the mins' -m sum_k x by a second MMA of A = -m: into f (F_SEP: two chains of dependent
    MMAs a tile, not one twice as long) or into d (8 tiles of x, short of registers)."""
    ws = split4(words)
    am = (pr[4], pr[5], pr[4], pr[5])  # registers 0 and 2 rows g, 1 and 3 rows g + 8
    for v in tl.static_range(V0, V0 + 2):
        a = _a_fragment_s(ws[v], pr, FP16)
        nd = ()
        nf = ()
        for j in tl.static_range(NB):
            lo = split4(xs[j][0])
            hi = split4(xs[j][1])
            b = (lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3])
            dj = _mma1(a, b[2 * v], b[2 * v + 1], d[j], FP16)
            if F_SEP:
                nf = nf + (_mma1(am, b[2 * v], b[2 * v + 1], f[j], FP16),)
            else:
                dj = _mma1(am, b[2 * v], b[2 * v + 1], dj, FP16)
            nd = nd + (dj,)
        d = nd
        if F_SEP:
            f = nf
    return d, f


@triton.jit
def _mma1(a, b0, b1, d, FP16: tl.constexpr):
    """d += A @ x's columns (b0, b1): a [16, 8] fragment in fp32, 4 [T] values a lane."""
    return tl.inline_asm_elementwise(
        _MMA1_F16 if FP16 else _MMA1_BF16, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r",
        [d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _neg_off_z(z, FP16: tl.constexpr):
    """-(OFF + z) of a row's group's zero point z (as loaded) as a pair of 16-bit floats ([T]
    uint32)."""
    bits = (_NEG_OFF_F16 if FP16 else _NEG_OFF_BF16) + z.to(tl.uint32)
    return bits | (bits << 16)


@triton.jit
def _block_loads(s_ptr, z_ptr, row_lo, row_hi, stride_sn, stride_zn, blk, GPB: tl.constexpr):
    """A block's groups' scales and zero points (or mins) for rows g and g + 8, as loaded:
    GPB tuples (s_lo, s_hi, z_lo, z_hi)."""
    raw = ()
    for gq in tl.static_range(GPB):
        grp = blk * GPB + gq
        raw = raw + ((tl.load(s_ptr + row_lo * stride_sn + grp),
                      tl.load(s_ptr + row_hi * stride_sn + grp),
                      tl.load(z_ptr + row_lo * stride_zn + grp),
                      tl.load(z_ptr + row_hi * stride_zn + grp)),)  # fmt: skip
    return raw


@triton.jit
def _mma(a, b0, b1, d, e, FP16: tl.constexpr, E4: tl.constexpr):
    """d += A @ x's columns (b0, b1), e += ones @ x's columns (every row the same: sum_k
    x[n, k]), both [16, 8] fragments in fp32, 4 [T] values a lane. e's last two equal its
    first two; E4: e carries all four (an MMA's accumulator is 4 registers, and feeding it two
    values twice costs two register copies a step, sm_90 SASS), else only the first two (8
    tiles of x, where two more registers a tile would spill)."""
    e2 = e[0]
    e3 = e[1]
    if E4:
        e2 = e[2]
        e3 = e[3]
    out = tl.inline_asm_elementwise(
        _MMA_F16 if FP16 else _MMA_BF16,
        "=f,=f,=f,=f,=f,=f,=f,=f,f,f,f,f,f,f,f,f,r,r,r,r,r,r",
        [d[0], d[1], d[2], d[3], e[0], e[1], e2, e3, a[0], a[1], a[2], a[3], b0, b1],
        dtype=(tl.float32,) * 8, is_pure=True, pack=1,
    )  # fmt: skip
    ne = (out[4], out[5])
    if E4:
        ne = (out[4], out[5], out[6], out[7])
    return (out[0], out[1], out[2], out[3]), ne


@triton.jit
def _emulated_step(qm_chunk, x_ptr, stride_xm, M, chunk, v, g, p, row0, d, e,
                   OFF: tl.constexpr, G32: tl.constexpr):  # fmt: skip
    """The interpreter's step: lane (g, p)'s sums for x's rows row0 + 2p, row0 + 2p + 1,
    computed from memory in fp32, reading the words of the 4 lanes that share its weight rows
    (the MMA's exchange between lanes): the shuffled layout's meaning, without the registers."""
    cc = tl.arange(0, 16)[None, :]  # the step's columns: lane p' = cc // 4, its 4 (h, e)
    word = tl.load(qm_chunk[:, None] + (4 * g[:, None] + cc // 4) * 4 + v)
    word = word.to(tl.uint32, bitcast=True)
    j = 4 * (cc % 2) + 2 * ((cc // 2) % 2)  # nibble 4e + 2h of the low row (r = 0)
    w_lo = ((word >> (4 * j)) & 0xF).to(tl.float32) + OFF
    w_hi = ((word >> (4 * j + 4)) & 0xF).to(tl.float32) + OFF
    if G32:
        col = chunk[:, None] * 64 + 32 * (v // 2) + 8 * (cc // 4) + 4 * (v % 2) + cc % 4
    else:
        col = chunk[:, None] * 64 + 16 * (cc // 4) + 4 * v + cc % 4
    n_a = (row0 + 2 * p)[:, None]
    x_a = tl.load(x_ptr + n_a * stride_xm + col, mask=n_a < M, other=0.0).to(tl.float32)
    x_b = tl.load(x_ptr + (n_a + 1) * stride_xm + col, mask=n_a + 1 < M, other=0.0).to(tl.float32)
    return (
        (d[0] + tl.sum(w_lo * x_a, axis=1), d[1] + tl.sum(w_lo * x_b, axis=1),
         d[2] + tl.sum(w_hi * x_a, axis=1), d[3] + tl.sum(w_hi * x_b, axis=1)),
        (e[0] + tl.sum(x_a, axis=1), e[1] + tl.sum(x_b, axis=1)),
    )  # fmt: skip


@triton.jit
def _pop(pend, DEPTH: tl.constexpr):
    """A queue of DEPTH operands in flight, oldest first: (the oldest, the rest)."""
    rest = ()
    for i in tl.static_range(1, DEPTH):
        rest = rest + (pend[i],)
    return pend[0], rest


@triton.jit
def _words(qm_tile, chunk, lane):
    """A lane's 4 words of a chunk of 64 columns ([T, 4], one 16-byte load)."""
    return tl.load(qm_tile + (chunk * 128 + lane * 4)[:, None] + tl.arange(0, 4)[None, :])


@triton.jit
def _x_pairs(x_pairs, x_rows, chunk, p, NB: tl.constexpr, G32: tl.constexpr):
    """A lane's 16 columns of a chunk for each of its NB rows of x (x_rows: their offsets
    from x_pairs, in pairs): per row 8 pairs as two 16-byte loads of [T, 4] (one load of
    [T, 8] is split between two threads and regathered through shared memory). Columns
    16p to 16p + 15, or with groups of 32 columns (G32) 8p to 8p + 7 and 32 + 8p to 32 + 8p +
    7 (`shuffle_w4`)."""
    cols = (chunk * 32 + p * (4 if G32 else 8))[:, None] + tl.arange(0, 4)[None, :]
    pairs = ()
    for j in tl.static_range(NB):
        ptrs = x_pairs + x_rows[j][:, None] + cols
        pairs = pairs + ((tl.load(ptrs), tl.load(ptrs + (16 if G32 else 4))),)
    return pairs


@triton.jit
def _chunk_sums(words, xs, d, e, nz, NB: tl.constexpr, ZSUB: tl.constexpr, FP16: tl.constexpr,
                E4: tl.constexpr, V0: tl.constexpr, V1: tl.constexpr):  # fmt: skip
    """d, e plus a chunk's steps V0 to V1 - 1 (a group's: all 4, or 2 of groups of 32
    columns) on its words and x's pairs, for each of the NB tiles of
    8 rows of x: one A fragment a step, shared by the tiles' MMAs. A holds OFF + q and e
    gathers sum_k x from MMAs against ones, or (ZSUB) A holds q - z (nz: the rows' -(OFF + z)
    pairs), one MMA a tile and step, e untouched. On an H200 (gpu_w4a16_mma_h200_run5.json,
    Llama-3.1-8B's four projections cold, the best launch each way): 64 rows 196.5 µs with
    ZSUB against 219.3, once the rows of x past M were read unmasked (run3, masked: 239.5
    against 217.7); 16 rows, see `zsub_default`."""
    ws = split4(words)
    bs = ()
    for j in tl.static_range(NB):
        lo = split4(xs[j][0])
        hi = split4(xs[j][1])
        bs = bs + ((lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]),)
    for v in tl.static_range(V0, V1):
        nd = ()
        if ZSUB:
            a = _a_fragment_z(ws[v], nz[0], nz[1], FP16)
            for j in tl.static_range(NB):
                nd = nd + (_mma1(a, bs[j][2 * v], bs[j][2 * v + 1], d[j], FP16),)
        else:
            a = _a_fragment(ws[v], FP16)
            ne = ()
            for j in tl.static_range(NB):
                dj, ej = _mma(a, bs[j][2 * v], bs[j][2 * v + 1], d[j], e[j], FP16, E4)
                nd = nd + (dj,)
                ne = ne + (ej,)
            e = ne
        d = nd
    return d, e


@triton.jit
def _w4a16_mma_kernel(
    x_ptr,  # [M, K] 16-bit
    qm_ptr,  # int32 [N / 16, K / 64, 32, 4]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G] zero points, or (MINS) float mins
    out_ptr,  # [M, N]
    M,
    K,
    stride_xm,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP: tl.constexpr,
    SPLIT: tl.constexpr,  # warps of the tile, each a run of K / SPLIT columns
    NB: tl.constexpr,  # tiles of 8 rows of x (the MMA's N)
    AHEAD: tl.constexpr,  # chunks of words in flight ahead of the one multiplied
    X_AHEAD: tl.constexpr,  # chunks of x loaded ahead of the one multiplied (0: as it goes)
    G32_CPB: tl.constexpr,  # chunks a block for groups of 32 (1 or 2)
    ZSUB: tl.constexpr,  # the zero points inside A (_chunk_sums)
    MINS: tl.constexpr,  # z_ptr holds float mins m (w = s q - m) in place of zero points
    SM: tl.constexpr,  # mins with the scales inside A (`_chunk_sums_sm`; 16-bit, x's type)
    EMULATE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    OFF: tl.constexpr = 1024.0 if FP16 else 128.0
    T: tl.constexpr = 32 * SPLIT
    tile = tl.program_id(0)
    tid = tl.arange(0, T)  # one value a thread: element i is thread i (lane i % 32)
    lane = tid % 32
    warp = tid // 32
    g = lane // 4  # the lane's weight rows g and g + 8, and its row of x as the MMA's B
    p = lane % 4  # its 16 columns of a chunk; its rows of x 2p, 2p + 1 in the sums
    row_lo = (tile * 16 + g).to(tl.int64)
    row_hi = row_lo + 8
    k_run = K // SPLIT
    # The lanes of a row of x past M read row M - 1 instead, unmasked: a column of B only
    # reaches the same column of the MMA's sums, and those of rows past M are not stored.
    x_rows = ()
    for j in tl.static_range(NB):
        x_rows = x_rows + (tl.minimum(8 * j + g, M - 1).to(tl.int64) * (stride_xm // 2),)
    x_pairs = x_ptr.to(tl.pointer_type(tl.uint32))
    qm_tile = qm_ptr + tile.to(tl.int64) * (K // 64) * 128
    zero = tl.zeros([T], dtype=tl.float32)
    fresh_d = ()
    fresh_e = ()
    E4: tl.constexpr = NB < 8 and not EMULATE  # _mma: e's four values carried
    E_HI: tl.constexpr = 2 if E4 else 0  # e's values for rows g + 8
    ZA: tl.constexpr = ZSUB and not EMULATE  # the zero points inside A (the interpreter: e)
    for _ in tl.static_range(NB):
        fresh_d = fresh_d + ((zero, zero, zero, zero),)
        fresh_e = fresh_e + (((zero, zero, zero, zero) if E4 else (zero, zero)),)
    t = fresh_d  # rows g, g + 8 by x's rows 8j + 2p, 8j + 2p + 1
    fsum = fresh_d  # SM: the mins' sums, -m sum_k x (`_chunk_sums_sm`)
    # A block: a group of 64 columns or more (CPB chunks), or G32_CPB chunks of two groups of
    # 32 each (steps 0-1 a chunk's first group's, 2-3 its second's: `shuffle_w4`)
    G32: tl.constexpr = GROUP == 32
    CPB: tl.constexpr = G32_CPB if G32 else GROUP // 64  # chunks a block
    GPC: tl.constexpr = 2 if G32 else 1  # groups a chunk
    GPB: tl.constexpr = CPB * GPC if G32 else 1  # groups a block
    BLOCK: tl.constexpr = 64 * CPB
    VPG: tl.constexpr = 4 // GPC  # steps of a chunk a group takes
    first = warp * (k_run // 64)  # the warp's chunks, a run of whole blocks
    last = first + k_run // 64 - 1
    # Each chunk's words are loaded AHEAD chunks before they are multiplied, and its x
    # X_AHEAD chunks before (by default 2 with one tile of x: ptxas issues a loop's loads late
    # in its body, and one chunk ahead left each load's latency exposed). More tiles of x
    # read theirs as they go (L1 and L2 hits): holding them ahead would take 16 registers a
    # tile and chunk.
    if not EMULATE:
        pend_w = ()  # the next AHEAD chunks' words, oldest first
        for i in tl.static_range(AHEAD):
            pend_w = pend_w + (_words(qm_tile, tl.minimum(first + i, last), lane),)
        pend_x = ()  # the next X_AHEAD chunks' x, oldest first
        for i in tl.static_range(X_AHEAD):
            nxt = _x_pairs(x_pairs, x_rows, tl.minimum(first + i, last), p, NB, G32)
            pend_x = pend_x + (nxt,)
    first_blk = first // CPB
    for bi in range(0, k_run // BLOCK):
        blk = first_blk + bi
        if SM:
            pairs = _sm_block(s_ptr, z_ptr, row_lo, row_hi, stride_sn, stride_zn, blk, FP16)
        else:
            raw = _block_loads(s_ptr, z_ptr, row_lo, row_hi, stride_sn, stride_zn, blk, GPB)
            sc = ()  # a group's scales and zero points (or mins) for rows g and g + 8
            acc = ()  # a group's sums (d, e)
            for gq in tl.static_range(GPB):
                s_lo = raw[gq][0].to(tl.float32)
                s_hi = raw[gq][1].to(tl.float32)
                if ZA:  # the zero points leave inside the A fragments
                    nz = (_neg_off_z(raw[gq][2], FP16), _neg_off_z(raw[gq][3], FP16))
                    z_lo = zero
                    z_hi = zero
                elif MINS:  # w = s q - m: the fold takes s OFF + m off each sum against ones
                    nz = (zero, zero)
                    z_lo = s_lo * OFF + raw[gq][2].to(tl.float32)
                    z_hi = s_hi * OFF + raw[gq][3].to(tl.float32)
                else:
                    nz = (zero, zero)
                    z_lo = raw[gq][2].to(tl.float32) + OFF
                    z_hi = raw[gq][3].to(tl.float32) + OFF
                sc = sc + ((s_lo, s_hi, z_lo, z_hi, nz),)
                acc = acc + ((fresh_d, fresh_e),)
        for ci in tl.static_range(CPB):
            chunk = blk * CPB + ci
            if EMULATE:
                nacc = ()
                for gq in tl.static_range(GPB):
                    if G32 and gq // GPC != ci:  # a group of another chunk of the block
                        nacc = nacc + (acc[gq],)
                    else:
                        nd = ()
                        ne = ()
                        for j in tl.static_range(NB):
                            dj = acc[gq][0][j]
                            ej = acc[gq][1][j]
                            for v in tl.static_range((gq % GPC) * VPG, (gq % GPC) * VPG + VPG):
                                dj, ej = _emulated_step(qm_tile + chunk * 128, x_ptr, stride_xm,
                                                        M, chunk, v, g, p, 8 * j, dj, ej, OFF,
                                                        G32)  # fmt: skip
                            nd = nd + (dj,)
                            ne = ne + (ej,)
                        nacc = nacc + ((nd, ne),)
                acc = nacc
            else:
                cur_w, rest_w = _pop(pend_w, AHEAD)
                pend_w = rest_w + (_words(qm_tile, tl.minimum(chunk + AHEAD, last), lane),)
                if X_AHEAD > 0:
                    cur_x, rest_x = _pop(pend_x, X_AHEAD)
                    nxt_x = _x_pairs(x_pairs, x_rows, tl.minimum(chunk + X_AHEAD, last), p, NB,
                                     G32)  # fmt: skip
                    pend_x = rest_x + (nxt_x,)
                else:
                    cur_x = _x_pairs(x_pairs, x_rows, chunk, p, NB, G32)
                if SM:
                    for gc in tl.static_range(2):
                        t, fsum = _chunk_sums_sm(cur_w, cur_x, t, fsum, pairs[2 * ci + gc], NB,
                                                 FP16, NB < 8, 2 * gc)  # fmt: skip
                else:
                    nacc = ()
                    for gq in tl.static_range(GPB):
                        if G32 and gq // GPC != ci:  # a group of another chunk of the block
                            nacc = nacc + (acc[gq],)
                        else:
                            d, e = _chunk_sums(cur_w, cur_x, acc[gq][0], acc[gq][1], sc[gq][4], NB,
                                               ZSUB, FP16, E4, (gq % GPC) * VPG,
                                               (gq % GPC) * VPG + VPG)  # fmt: skip
                            nacc = nacc + ((d, e),)
                    acc = nacc
        if not SM:  # each group's sums folded into t
            for gq in tl.static_range(GPB):
                s_lo = sc[gq][0]
                s_hi = sc[gq][1]
                z_lo = sc[gq][2]
                z_hi = sc[gq][3]
                nt = ()
                for j in tl.static_range(NB):
                    tj = t[j]
                    dj = acc[gq][0][j]
                    ej = acc[gq][1][j]
                    if ZA:  # d holds sum_k (q - z) x already
                        nt = nt + ((tj[0] + s_lo * dj[0], tj[1] + s_lo * dj[1],
                                    tj[2] + s_hi * dj[2], tj[3] + s_hi * dj[3]),)  # fmt: skip
                    elif MINS:  # z: s OFF + m
                        nt = nt + ((
                            tj[0] + (s_lo * dj[0] - z_lo * ej[0]),
                            tj[1] + (s_lo * dj[1] - z_lo * ej[1]),
                            tj[2] + (s_hi * dj[2] - z_hi * ej[E_HI]),
                            tj[3] + (s_hi * dj[3] - z_hi * ej[E_HI + 1]),
                        ),)  # fmt: skip
                    else:
                        nt = nt + ((
                            tj[0] + s_lo * (dj[0] - z_lo * ej[0]),
                            tj[1] + s_lo * (dj[1] - z_lo * ej[1]),
                            tj[2] + s_hi * (dj[2] - z_hi * ej[E_HI]),
                            tj[3] + s_hi * (dj[3] - z_hi * ej[E_HI + 1]),
                        ),)  # fmt: skip
                t = nt
    if SM:
        nt = ()
        for j in tl.static_range(NB):
            nt = nt + ((t[j][0] + fsum[j][0], t[j][1] + fsum[j][1], t[j][2] + fsum[j][2],
                        t[j][3] + fsum[j][3]),)  # fmt: skip
        t = nt
    for j in tl.static_range(NB):
        _store_sums(out_ptr, stride_om, tile, t[j][0], 8 * j, 0, M, SPLIT)
        _store_sums(out_ptr, stride_om, tile, t[j][1], 8 * j + 1, 0, M, SPLIT)
        _store_sums(out_ptr, stride_om, tile, t[j][2], 8 * j, 8, M, SPLIT)
        _store_sums(out_ptr, stride_om, tile, t[j][3], 8 * j + 1, 8, M, SPLIT)


@triton.jit
def _store_sums(out_ptr, stride_om, tile, t, N_OFF: tl.constexpr, R_OFF: tl.constexpr, M,
                SPLIT: tl.constexpr):  # fmt: skip
    """One of a lane's sums, the warps' runs added in order: lane l holds weight row
    16 tile + l // 4 + R_OFF and x's row 2 (l % 4) + N_OFF."""
    ln = tl.arange(0, 32)
    n = 2 * (ln % 4) + N_OFF
    total = tl.sum(tl.reshape(t, [SPLIT, 32]), axis=0)
    ptrs = out_ptr + n * stride_om + tile * 16 + ln // 4 + R_OFF
    tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=n < M)


def n_tiles(m: int) -> int:
    """Tiles of 8 rows of x for m rows: a power of two (one compile each), at most NB_MAX."""
    return min(NB_MAX, next_pow2(-(-m // 8)))


# The most warps an SM a launch's grid fills by splitting K, by tiles of x (`n_tiles`), and
# the fewest warps a tile from 4 tiles of x: more tiles of x hold more registers a warp, and
# past these the partial sums cost more than the split's parallelism gives. Fitted on an H200
# to Llama-3.1-8B's four projections at 1 to 64 rows of x, every launch of warps 2/4/8 x
# chunks ahead 2/4/8 x zero points inside A or not (loadtest/results/
# gpu_w4a16_mma_h200_run5.json, µs summed over the four): 64 rows 234.4 with the earlier rule
# (4 warps a tile, 2 ahead, zero points by the MMAs against ones) against 196.5 for the best
# launch each; 32 rows 125.5 against 109.5.
_WARPS_PER_SM = {1: 64, 2: 64, 4: 16, 8: 8}
_MIN_SPLIT = {1: 1, 2: 1, 4: 2, 8: 2}


def mma_split(k: int, group_size: int, n: int, sms: int, m: int = 1) -> int:
    """Warps a tile for m rows of x, each a run of whole groups of K: a power of two up to 8
    (4 for 8 tiles of x, whose sums take most of a thread's registers), while the grid has at
    most _WARPS_PER_SM warps an SM (_MIN_SPLIT at least). For one row of x on an H200: qkv
    7.3 µs with 8 warps, o 5.8, down 13.7, gate_up (1,792 tiles) 20.6 with 4; for 64, qkv
    27.8 with 2, gate_up 107.0 with 2, o 16.8 and down 44.9 with 4 (run5)."""
    nb = n_tiles(m)
    cap = 4 if nb == NB_MAX else 8
    tiles = n // TILE_N
    split = 1
    while split < cap and k % (2 * split * group_size) == 0:
        if split >= _MIN_SPLIT[nb] and tiles * 2 * split > _WARPS_PER_SM[nb] * sms:
            break
        split *= 2
    return split


def mma_ahead(m: int) -> int:
    """Chunks of words a warp loads ahead for m rows of x by default: 4 for 8 tiles of x (64
    rows: gate_up 107.4 µs against 114.7 with 2), else 2 (deeper was within noise or slower
    with fewer tiles: down at 32 rows 25.6 µs with 2, 35.4 with 4; run5)."""
    return 4 if n_tiles(m) == NB_MAX else AHEAD


def zsub_default(m: int, n: int, split: int, sms: int) -> bool:
    """Whether m rows of x take the zero points off inside A (`_chunk_sums`) by default: yes,
    but for 2 tiles of x in a grid of fewer than 20 warps an SM, where the MMAs against ones
    were faster (16 rows: o 7.7 µs against 8.6, down 17.0 against 20.4; qkv at 23 warps an
    SM 10.2 against 11.2; run5). One row: 47.5 µs for the four projections against 48.0."""
    return n_tiles(m) != 2 or (n // TILE_N) * split >= 20 * sms


def mma_block(k: int, group_size: int) -> int:
    """Columns of the blocks a warp's run is whole blocks of: a group of 64 columns or more;
    for groups of 32, two chunks (four groups) where k has whole pairs of chunks, else one.
    With the scales inside A a loop body takes such a block (the operands in flight kept in
    place, where one chunk's body copied them, sm_90 SASS; the 4 groups' scales in one load
    each, `_sm_block`); folding, one chunk (splits of these blocks split chunks as well)."""
    if group_size != G32:
        return max(group_size, CHUNK)
    return 2 * CHUNK if k % (2 * CHUNK) == 0 else CHUNK


def split_at_most(k: int, group_size: int, split: int) -> int:
    """The largest power of two up to `split` that divides k's groups (a launch's warps a
    tile, for a shape with fewer groups than it asks)."""
    while split > 1 and k % (split * group_size):
        split //= 2
    return split


def mma_shape_fits(n: int, k: int, group_size: int) -> bool:
    """Whether a weight [n, k] with these groups can be shuffled for `w4a16_mma` (and expanded
    by kernels/w4a16_mma_dequant.py): n a multiple of 16, power-of-two groups of at least 32
    columns (groups of 32 in their own layout) dividing k, k a multiple of 64."""
    return (
        n % TILE_N == 0
        and group_size >= G32
        and group_size & (group_size - 1) == 0
        and k % group_size == 0
        and k % CHUNK == 0
    )


def check_shuffled(
    op: str,
    qmma: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    device: torch.device,
    *,
    mins: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Check a weight's shuffled words (contiguous int32 [n / 16, k / 64, 32, 4]), its groups
    (power-of-two, at least 32 columns) and the layout's scales and either its uint8
    zero points or float mins [n, k / group_size], all on `device`; returns (n, k)."""
    check_tensor(op, "qmma", qmma, shape=(None, None, 32, 4), dims="[n / 16, k / 64, 32, 4]",
                 dtypes=(torch.int32,), device=device)  # fmt: skip
    if not qmma.is_contiguous():
        raise ValueError(f"{op}: qmma must be contiguous, got strides {qmma.stride()}")
    n, k = qmma.shape[0] * TILE_N, qmma.shape[1] * CHUNK
    if group_size < G32 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(
            f"{op}: group_size must be a power of two dividing k = {k}, groups of at least "
            f"{G32} columns, got {group_size}"
        )
    if zeros is not None and mins is None:
        offsets = ("zeros", zeros, (torch.uint8,))
    elif mins is not None and zeros is None:
        offsets = ("mins", mins, SCALE_DTYPES)
    else:
        raise ValueError(f"{op}: give zero points (zeros) or mins, not both or neither")
    for name, t, dtypes in (("scales", scales, SCALE_DTYPES), offsets):
        check_tensor(op, name, t, shape=(n, k // group_size), dims="[n, k / group_size]",
                     dtypes=dtypes, device=device)  # fmt: skip
    return n, k


def mma_fits(x: torch.Tensor, n: int, k: int, group_size: int) -> bool:
    """Whether `w4a16_mma` takes this product: the weight's shape (`mma_shape_fits`) and 1 to
    64 rows of 16-bit x, contiguous columns, 16-byte aligned rows."""
    return (
        mma_shape_fits(n, k, group_size)
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == k
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
    )


def _scales_inside(
    x: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int, block: int
) -> bool:
    """Whether a launch with mins takes its scales inside A (`_chunk_sums_sm`): natively, groups
    of 32 in blocks of two chunks, scales and mins of x's 16-bit type in rows of whole 8-byte
    words (`_sm_block`'s loads). Else the groups' sums are folded (by the MMAs against ones).
    In fp16, -OFF s overflows for |s| >= 64 (OFF = 1024): such scales must come as fp32 (the
    GGUF conversion keeps them so)."""
    if mins is None or group_size != G32 or block != 2 * CHUNK or interpreting():
        return False
    return all(
        t.dtype == x.dtype and t.stride(1) == 1 and t.stride(0) % 4 == 0 and t.data_ptr() % 8 == 0
        for t in (scales, mins)
    )


def w4a16_mma(
    x: torch.Tensor,
    qmma: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    group_size: int,
    out: torch.Tensor | None = None,
    split: int | None = None,
    ahead: int | None = None,
    zsub: bool | None = None,
    x_ahead: int | None = None,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ w.T for 1 to 64 rows of x, w as `shuffle_w4` stores it; returns out.

    x: [m, k] bf16/fp16, contiguous columns, rows 16-byte aligned (`mma_fits`); qmma: int32
    [n / 16, k / 64, 32, 4]; scales [n, G], zeros uint8 [n, G] as in kernels/w4a16.py (no
    act-order perm: gather x's columns first), or zeros None and mins [n, G] floats for
    weights s q - m (GGUF's Q4_K; with scales and mins of x's type, in rows of whole 8-byte
    words, the scales go inside A: `_scales_inside`). Groups of 32 columns take `shuffle_w4`'s
    layout of their own. out (optional, written): [m, n] of x's dtype,
    contiguous rows of any stride. split: warps a tile (a power of two dividing k's groups;
    None: `mma_split`). ahead: chunks of 64 columns whose words a warp has in flight ahead of
    the one it multiplies (1 to 16; None: `mma_ahead`). zsub: the zero points taken off
    inside the A fragments instead of by MMAs against ones (None: `zsub_default`). x_ahead:
    chunks of x loaded ahead (0 to 4; None: 2 for up to 8 rows, else 0: more tiles of x read
    theirs as they go). One row of x on an H200, the four projections' best split: 48.0 µs
    with 2 ahead, 50.0 with 1 (48 registers a thread against 56, 40 warps an SM against 36),
    52.1 with 0 (loadtest/results/gpu_w4a16_mma_xahead_h200_run1.json).
    """
    op = "w4a16_mma"
    check_tensor(
        op, "x", x, shape=(None, None), dims="[m, k]", dtypes=(torch.bfloat16, torch.float16)
    )
    m, k = x.shape
    check_tensor(op, "qmma", qmma, shape=(None, k // CHUNK, 32, 4), dims="[n / 16, k / 64, 32, 4]",
                 dtypes=(torch.int32,), device=x.device)  # fmt: skip
    n, _ = check_shuffled(op, qmma, scales, zeros, group_size, x.device, mins=mins)
    if not mma_fits(x, n, k, group_size):
        raise ValueError(
            f"{op}: takes 1 to {MAX_M} rows of x with 16-byte aligned rows, n % {TILE_N} == 0 "
            f"and power-of-two groups of at least {G32} dividing k; got x {tuple(x.shape)} "
            f"(row stride {x.stride(0)}), n = {n}, group_size = {group_size}"
        )
    block = mma_block(k, group_size)
    sms = sm_count(x.device) if x.is_cuda else 132
    if split is None:
        split = mma_split(k, block, n, sms, m)
    if ahead is None:
        ahead = mma_ahead(m)
    if zsub is None:
        zsub = mins is None and zsub_default(m, n, split, sms)
    if zsub and mins is not None:
        raise ValueError(f"{op}: zsub takes integer zero points, not mins")
    if split < 1 or split & (split - 1) or k % (split * block):
        raise ValueError(f"{op}: split must be a power of two dividing k's blocks, got {split}")
    if not isinstance(ahead, int) or not 1 <= ahead <= 16:
        raise ValueError(f"{op}: ahead must be 1 to 16 chunks, got {ahead!r}")
    if x_ahead is not None and (not isinstance(x_ahead, int) or not 0 <= x_ahead <= 4):
        raise ValueError(f"{op}: x_ahead must be 0 to 4 chunks, got {x_ahead!r}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    if out.stride(1) != 1:
        raise ValueError(f"{op}: out's columns must be contiguous, got strides {out.stride()}")
    offsets = mins if zeros is None else zeros
    assert offsets is not None  # check_shuffled: one of them
    # Blocks of two chunks only with the scales inside A: folding, the four groups' sums of a
    # block would stay live to its end (255 registers and spills at 8 tiles of x, ptxas -v)
    sm = _scales_inside(x, scales, mins, group_size, block)
    _w4a16_mma_kernel[(n // TILE_N,)](
        x, qmma, scales, offsets, out, m, k, x.stride(0), scales.stride(0), offsets.stride(0),
        out.stride(0), GROUP=group_size, SPLIT=split, NB=n_tiles(m), AHEAD=ahead,
        X_AHEAD=(2 if n_tiles(m) == 1 else 0) if x_ahead is None else x_ahead,
        G32_CPB=block // CHUNK if sm else 1,
        ZSUB=zsub, MINS=mins is not None, SM=sm,
        EMULATE=interpreting(),
        num_warps=split, num_stages=1, **pdl_launch(x.device),
    )  # fmt: skip
    return out
