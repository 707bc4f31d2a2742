"""Dequantise int4 weights (the layout of kernels/w4a16.py) to a dense [N, K] matrix on the GPU.

Prefill multiplies many tokens by each weight, so it is compute-bound: the fastest product is
cuBLAS's tensor-core GEMM, and the cost of first expanding the weight to x's dtype (read half
a byte a weight, write two, read them again) is paid once for all the tokens of the batch.
kernels/w4a16_matmul.py does exactly that, a slice of rows at a time, as
kernels/gguf_matmul.py does for GGUF blocks.

Each program reads a [BLOCK_N, BLOCK_W] tile of packed words, each word once, with one
coalesced load; the 8 nibbles of every word are shifted out along a new last dimension
([BLOCK_N, BLOCK_W, 8]: nibble j of word w is column 8w + j) and the tile is stored as
[BLOCK_N, 8 * BLOCK_W] contiguous columns. A word's 8 columns lie in one group (group_size
>= 16), so the scales and zero points are read per word, not per weight. Compiled for sm90
(checked without a GPU: 16 x 64 words, 4 warps, 48 registers in bf16, no spills), the words
load as 16-byte vectors, reach the [.., 8] layout through a small shared-memory conversion,
and the weights are stored as 16-byte vectors.

With an act-order perm the weight is not reordered (column k stays the weight's column k, the
one that multiplies x[:, perm[k]]); its padding columns (perm -1) are written as 0, so that the
caller may gather x's columns with the -1s clamped to any column (w4a16_matmul takes column
0): a zero weight column makes that column's product 0 for every finite x.

Grid: (cdiv(N, BLOCK_N), cdiv(K / 8, BLOCK_W)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.w4a16 import PACK, check_weight, load_words


@triton.jit
def _dequant_kernel(
    qw_ptr,  # int32 [N, K / 8]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G]
    perm_ptr,  # int32 [K] (HAS_PERM)
    out_ptr,  # [N, K]
    N,
    WORDS,  # K / 8
    stride_qn,
    stride_sn,
    stride_zn,
    stride_on,
    HAS_PERM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    n_mask = offs_n < N
    w_mask = offs_w < WORDS
    mask = n_mask[:, None] & w_mask[None, :]
    rows = offs_n.to(tl.int64)
    q, s, z = load_words(
        qw_ptr, s_ptr, z_ptr, rows[:, None], offs_w[None, :], mask,
        stride_qn, stride_sn, stride_zn, GROUP,
    )  # fmt: skip
    j = tl.arange(0, 8)
    nib = (q[:, :, None] >> (4 * j)[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_W, 8]
    # (q - z) * s in fp32, as dequantize_w4 computes it: exact integers times the scale, one
    # rounding, then one more to out's dtype
    w = (nib.to(tl.float32) - z[:, :, None]) * s[:, :, None]
    cols = offs_w[:, None] * 8 + j[None, :]  # [BLOCK_W, 8]
    if HAS_PERM:
        src = tl.load(perm_ptr + cols, mask=w_mask[:, None], other=0)
        w = tl.where((src >= 0)[None, :, :], w, 0.0)
    w = tl.reshape(w, [BLOCK_N, BLOCK_W * 8])
    cols = tl.reshape(cols, [BLOCK_W * 8])
    out_ptrs = out_ptr + rows[:, None] * stride_on + cols[None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (cols < WORDS * 8))


def w4a16_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 16,
    block_w: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """The weight [n, k] of `dtype` from the int4 layout (kernels/w4a16.py); returns out.

    Column k is the weight's column k (the perm is not applied): dequantize_w4's result, with
    the perm's padding columns (-1) zero. qweight, scales, zeros, perm: the layout (contiguous
    last dimensions, any row strides). out (optional, written): [n, k] of `dtype`, rows of any
    stride. block_n, block_w: rows and packed words (8 columns each) per program, powers of two.
    """
    op = "w4a16_dequantize"
    n, k = check_weight(op, qweight, scales, zeros, group_size, perm)
    check_device(op, qweight)
    device = qweight.device
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be a float dtype, got {dtype}")
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=device)
    check_tensor(op, "out", out, shape=(n, k), dims="[n, k]", dtypes=(dtype,), device=device)
    for name, size in (("block_n", block_n), ("block_w", block_w)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {size}")
    if n == 0 or k == 0:
        return out
    words = k // PACK
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(words, block_w))](
        qweight,
        scales,
        zeros,
        qweight if perm is None else perm,  # never read without a perm
        out,
        n,
        words,
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        HAS_PERM=perm is not None,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_W=block_w,
        num_warps=num_warps,
        **pdl_launch(device),
    )
    return out
