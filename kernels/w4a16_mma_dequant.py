"""Dequantise int4 weights stored shuffled for the decode MMA (kernels/w4a16_mma.shuffle_w4) to
a dense [N, K] matrix, for prefill's cuBLAS products (kernels/w4a16_matmul), as
kernels/w4a16_dequant.py does for the plain layout.

A program takes one tile of 16 weight rows and a run of 64-column chunks. A chunk is 32 lanes'
16-byte loads of 4 words; each word's 8 nibbles are weights (row g + 8r, column 16p + 4v +
2h + e) for lane 4g + p, step v and nibble 4e + 2h + r, so the [32, 4, 8] tile of nibbles is
reordered into the chunk's [16, 64] block of the weight (rows r g, columns p v h e) before
one contiguous store a row. A chunk lies in one quantisation group (groups of at least 64
columns), whose scale and zero point are read once a row; or, in the layout of groups of 32
columns (`shuffle_w4(..., group_size=32)`: column 32 vh + 8p + 4 vl + 2h + e for step 2 vh +
vl), in two groups, each with its scale and zero point or its float min (w = s q - m: GGUF's
Q4_K, kernels/gguf_q4k_mma.py).

The perm of an act-order weight is not applied (column k stays the weight's column k); the
caller gathers x's columns, padding columns as 0, so that the padding weights, finite, add 0.

Grid: (N / 16, cdiv(K / 64, CHUNKS)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16_mma import CHUNK, TILE_N, check_shuffled

CHUNKS = 8  # chunks of 64 columns a program


@triton.jit
def _mma_dequant_kernel(
    qm_ptr,  # int32 [N / 16, K / 64, 32, 4]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G] zero points, or (MINS) float mins
    out_ptr,  # [N, K]
    NUM_CHUNKS,  # K / 64
    stride_sn,
    stride_zn,
    stride_on,
    GROUP: tl.constexpr,
    CHUNKS: tl.constexpr,
    MINS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    lane = tl.arange(0, 32)[:, None, None]
    v = tl.arange(0, 4)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    r = tl.arange(0, 16)  # the block's rows: 8 (j % 2) + lane // 4
    rows = (tile * 16 + r).to(tl.int64)
    cols = tl.arange(0, 64)
    dtype = out_ptr.dtype.element_ty
    for i in range(0, CHUNKS):
        chunk = tl.program_id(1) * CHUNKS + i
        if chunk < NUM_CHUNKS:
            base = qm_ptr + (tile.to(tl.int64) * NUM_CHUNKS + chunk) * 128
            words = tl.load(base + lane * 4 + v).to(tl.uint32, bitcast=True)  # [32, 4, 1]
            q = ((words >> (4 * j)) & 0xF).to(tl.float32)  # [32, 4, 8]
            if GROUP == 32:
                # lane 4g + p, step 2 vh + vl, nibble 4e + 2h + r -> [r, g, vh, p, vl, h, e]
                q = tl.reshape(q, [8, 4, 2, 2, 2, 2, 2])  # g p vh vl e h r
                q = tl.reshape(tl.permute(q, [6, 0, 2, 1, 3, 5, 4]), [16, 2, 32])
                grp = chunk * 2 + tl.arange(0, 2)  # the chunk's two groups
                at_s = s_ptr + rows[:, None] * stride_sn + grp[None, :]
                s = tl.load(at_s).to(tl.float32)[:, :, None]
                z = tl.load(z_ptr + rows[:, None] * stride_zn + grp[None, :]).to(tl.float32)
                if MINS:
                    w = tl.reshape(q * s - z[:, :, None], [16, 64])
                else:
                    w = tl.reshape((q - z[:, :, None]) * s, [16, 64])
            else:
                # lane 4g + p, step v, nibble 4e + 2h + r -> [r, g, p, v, h, e] = [16, 64]
                q = tl.reshape(q, [8, 4, 4, 2, 2, 2])  # g p v e h r
                q = tl.reshape(tl.permute(q, [5, 0, 1, 2, 4, 3]), [16, 64])
                grp = chunk * 64 // GROUP
                s = tl.load(s_ptr + rows * stride_sn + grp).to(tl.float32)
                z = tl.load(z_ptr + rows * stride_zn + grp).to(tl.float32)
                w = q * s[:, None] - z[:, None] if MINS else (q - z[:, None]) * s[:, None]
            ptrs = out_ptr + rows[:, None] * stride_on + (chunk * 64 + cols)[None, :]
            tl.store(ptrs, w.to(dtype))


def w4a16_mma_dequantize(
    qmma: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight [n, k] of `dtype` from its words shuffled for the MMA (int32 [n / 16, k / 64,
    32, 4], contiguous) and the layout's scales and zero points [n, k / group_size] (or zeros
    None and float mins: w = s q - m); returns out (optional, written: [n, k] of `dtype`, rows
    of any stride). Groups of 32 columns take `shuffle_w4`'s layout of their own."""
    op = "w4a16_mma_dequantize"
    check_device(op, qmma)
    n, k = check_shuffled(op, qmma, scales, zeros, group_size, qmma.device, mins=mins)
    tiles, chunks = n // TILE_N, k // CHUNK
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be a float dtype, got {dtype}")
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=qmma.device)
    check_tensor(op, "out", out, shape=(n, k), dims="[n, k]", dtypes=(dtype,), device=qmma.device)
    if n == 0 or k == 0:
        return out
    offsets = mins if zeros is None else zeros
    assert offsets is not None  # check_shuffled: one of them
    _mma_dequant_kernel[(tiles, triton.cdiv(chunks, CHUNKS))](
        qmma, scales, offsets, out, chunks, scales.stride(0), offsets.stride(0), out.stride(0),
        GROUP=group_size, CHUNKS=CHUNKS, MINS=mins is not None, num_warps=4,
        **pdl_launch(qmma.device),
    )  # fmt: skip
    return out
