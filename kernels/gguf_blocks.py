"""llama.cpp's GGUF weight blocks as the GPU keeps them, and how one tile of them is decoded.

A quantized GGUF matrix [n, k] is kept as its file bytes: a uint8 tensor [n, k / elems * bytes],
one row of blocks per output feature, each block `elems` consecutive weights of that row. The
types decoded here (byte offsets within one block):

    Q8_0  32 weights, 34 bytes:  d fp16 @0, q int8[32] @2;                     w = d * q
    Q4_K  256 weights, 144 bytes: d fp16 @0, dmin fp16 @2, 12 bytes of eight 6-bit scales and
          eight 6-bit mins @4, 128 bytes of nibbles @16; sub-block j (32 weights) takes
          w = d * scale[j] * q - dmin * min[j], q the low (j even) or high (j odd) nibbles of
          bytes 32 * (j // 2) .. + 31
    Q6_K  256 weights, 210 bytes: ql[128] @0 (low 4 bits), qh[64] @128 (high 2 bits), int8
          scales[16] @192 (one per 16 weights), d fp16 @208;       w = d * scale[i // 16] * (q - 32)

`decode_groups` (the Triton function of the dequantise kernel, kernels/gguf_dequant.py) turns
a tile of rows by scale groups into fp32 weights [rows, groups, group]: per-group fields (fp16
scales, packed 6-bit scales) are read once per group, and every weight is one byte load.
`dequantize_ref` is its torch twin, computing each weight with the same fp32 operations in the
same order as the `gguf` package's numpy dequantisers, so the two agree bit for bit. (The
decode GEMV, kernels/gguf_gemv.py, reads the same layouts its own way, as words and
halfwords, and never forms the weights: it applies the scales to sums.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor


class BlockLayout(NamedTuple):
    type_id: int  # ggml's type number (GGMLQuantizationType), the kernels' QTYPE
    elems: int  # weights per block (super-block for the K-quants)
    bytes: int  # bytes per block
    group: int  # weights sharing one scale: the innermost dimension of a decoded tile


LAYOUTS = {
    "Q8_0": BlockLayout(type_id=8, elems=32, bytes=34, group=32),
    "Q4_K": BlockLayout(type_id=12, elems=256, bytes=144, group=32),
    "Q6_K": BlockLayout(type_id=14, elems=256, bytes=210, group=16),
}
# (byte offset in the block, spread of the random values) of each type's fp16 fields
_FP16_FIELDS = {"Q8_0": [(0, 0.02)], "Q4_K": [(0, 0.004), (2, 0.01)], "Q6_K": [(208, 0.002)]}
_Q8_0: tl.constexpr = tl.constexpr(8)
_Q4_K: tl.constexpr = tl.constexpr(12)
_Q6_K: tl.constexpr = tl.constexpr(14)


def layout(op: str, qtype: str) -> BlockLayout:
    """The layout of `qtype` (ggml's name: "Q8_0", "Q4_K", "Q6_K"); ValueError naming the others."""
    try:
        return LAYOUTS[qtype]
    except KeyError:
        raise ValueError(
            f"{op}: GGUF type {qtype!r} has no GPU kernel; supported: {', '.join(LAYOUTS)}"
        ) from None


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k weights of `qtype`; ValueError unless k is a whole number of blocks."""
    lay = layout("gguf", qtype)
    if k % lay.elems:
        raise ValueError(f"gguf: {qtype} rows hold multiples of {lay.elems} weights, got {k}")
    return k // lay.elems * lay.bytes


def check_blocks(
    op: str, blocks: torch.Tensor, qtype: str, k: int, device: torch.device | None = None
) -> BlockLayout:
    """`blocks` must be uint8 [n, row_bytes(qtype, k)], rows of any stride (a multiple of 2,
    since the fp16 fields are read two bytes at a time)."""
    lay = layout(op, qtype)
    if k % lay.elems:
        raise ValueError(f"{op}: {qtype} rows hold multiples of {lay.elems} weights, got k={k}")
    check_tensor(
        op,
        "blocks",
        blocks,
        shape=(None, k // lay.elems * lay.bytes),
        dims=f"[n, k / {lay.elems} * {lay.bytes}]",
        dtypes=(torch.uint8,),
        device=device,
    )
    if blocks.shape[0] > 1 and blocks.stride(0) % 2:
        raise ValueError(f"{op}: blocks' row stride must be even, got {blocks.stride(0)}")
    if blocks.data_ptr() % 2:
        raise ValueError(f"{op}: blocks must start at an even address")
    return lay


@triton.jit
def _fp16_at(w_ptr, offs, mask):
    """fp32 value of the little-endian fp16 at byte offsets `offs` (even, as GGUF keeps them)."""
    bits = tl.load((w_ptr + offs).to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def decode_groups(w_ptr, rows, gi, mask, QTYPE: tl.constexpr, GROUP: tl.constexpr):
    """fp32 weights [R, G, GROUP] of rows `rows` ([R] int64 byte offsets of each row's first
    block) and scale groups `gi` ([G] int: group g holds the row's weights g * GROUP ...);
    `mask` [R, G] says which exist (the others come back 0)."""
    e = tl.arange(0, GROUP)[None, None, :]
    m3 = mask[:, :, None]
    if QTYPE == _Q8_0:
        base = rows[:, None] + (gi * 34)[None, :]  # [R, G]: one block per group
        d = _fp16_at(w_ptr, base, mask)
        q = tl.load(w_ptr + base[:, :, None] + 2 + e, mask=m3, other=0)
        return q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, :, None]
    elif QTYPE == _Q4_K:
        j = (gi % 8)[None, :]  # sub-block of its super-block
        base = rows[:, None] + (gi // 8 * 144)[None, :]
        d = _fp16_at(w_ptr, base, mask)
        dmin = _fp16_at(w_ptr, base + 2, mask)
        # the 12 scale bytes s: j < 4 keeps scale j and min j in the low 6 bits of s[j] and
        # s[j + 4]; j >= 4 has its low 4 bits in s[j + 4] (scale low, min high nibble) and
        # its top 2 bits in the spare top bits of s[j - 4] (scale) and s[j] (min).
        a = tl.load(w_ptr + base + 4 + j, mask=mask, other=0).to(tl.int32)
        b = tl.load(w_ptr + base + 8 + j, mask=mask, other=0).to(tl.int32)
        c = tl.load(w_ptr + base + 4 + j % 4, mask=mask, other=0).to(tl.int32)
        low = j < 4
        sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        scale = d * sc.to(tl.float32)
        minv = dmin * mn.to(tl.float32)
        nib = base + 16 + 32 * (j // 2)
        q = tl.load(w_ptr + nib[:, :, None] + e, mask=m3, other=0).to(tl.int32)
        q = (q >> (4 * (j % 2))[:, :, None]) & 15
        return scale[:, :, None] * q.to(tl.float32) - minv[:, :, None]
    else:
        tl.static_assert(QTYPE == _Q6_K)
        t = (gi % 16)[None, :]  # scale index in its super-block; weights 16 t ... 16 t + 15
        half = t // 8  # each 128-weight half has its own 64 ql and 32 qh bytes
        base = rows[:, None] + (gi // 16 * 210)[None, :]
        d = _fp16_at(w_ptr, base + 208, mask)
        sc = tl.load(w_ptr + base + 192 + t, mask=mask, other=0).to(tl.int8, bitcast=True)
        scale = d * sc.to(tl.float32)
        # within a half, weight r's low bits are nibble r // 64 of ql[r % 64] and its high
        # bits are bit pair r // 32 of qh[r % 32]
        ql_at = base + 64 * half + 16 * (t % 4)
        qh_at = base + 128 + 32 * half + 16 * (t % 2)
        ql = tl.load(w_ptr + ql_at[:, :, None] + e, mask=m3, other=0).to(tl.int32)
        qh = tl.load(w_ptr + qh_at[:, :, None] + e, mask=m3, other=0).to(tl.int32)
        ql = (ql >> (4 * (t % 8 // 4))[:, :, None]) & 15
        qh = (qh >> (2 * (t % 8 // 2))[:, :, None]) & 3
        return scale[:, :, None] * ((ql | (qh << 4)) - 32).to(tl.float32)


def _fp16_field(b: torch.Tensor, at: int) -> torch.Tensor:
    """fp32 [..., 1] from the fp16 at byte `at` of each block b [..., bytes]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()


def q4k_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows of blocks [n, row bytes] -> (q int32 [n, k] in 0..15, scale and min fp32
    [n, k / 32]): each weight is scale * q - min of its sub-block of 32."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 144)  # [n, blocks, bytes]
    s = b[..., 4:16].int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    scale = _fp16_field(b, 0) * sc.float()  # [n, blocks, 8]
    minv = _fp16_field(b, 2) * mn.float()
    qs = b[..., 16:].int().reshape(n, -1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1)
    return q, scale.reshape(n, -1), minv.reshape(n, -1)


def dequantize_ref(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """The torch twin of `decode_groups`: fp32 weights [n, k] of rows of blocks [n, row bytes]
    (any device)."""
    lay = layout("dequantize_ref", qtype)
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, lay.bytes)  # [n, blocks, bytes]
    if qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * _fp16_field(b, 0)).reshape(n, -1)
    if qtype == "Q4_K":
        q, scale, minv = q4k_fields(blocks)
        q = q.reshape(n, -1, 32).float()
        return (scale[..., None] * q - minv[..., None]).reshape(n, -1)
    ql = b[..., :128].int().reshape(n, -1, 2, 1, 64)
    qh = b[..., 128:192].int().reshape(n, -1, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(n, -1, 256)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, -1, 256)
    q = ((low | (high << 4)) - 32).reshape(n, -1, 16, 16).float()
    scale = _fp16_field(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()
    return (scale[..., None] * q).reshape(n, -1)


def random_blocks(
    n: int, k: int, qtype: str, gen: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """uint8 [n, row_bytes(qtype, k)] of valid random blocks for tests and benchmarks: every
    packed field random (each bit pattern of them is valid), the fp16 scales finite, some
    negative (llama.cpp's quantisers never write those, but the format allows them), drawn
    from `gen` on the CPU and moved, so any device gets the same blocks."""
    lay = layout("random_blocks", qtype)
    nb = k // lay.elems
    blocks = torch.randint(0, 256, (n, nb, lay.bytes), generator=gen, dtype=torch.uint8)
    for at, spread in _FP16_FIELDS[qtype]:
        values = (torch.randn(n, nb, 1, generator=gen) * spread).half()
        blocks[..., at : at + 2] = values.view(torch.uint8)
    return blocks.reshape(n, nb * lay.bytes).to(device)
