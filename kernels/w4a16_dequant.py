"""Dequantise int4 weights (the layout of kernels/w4a16.py) to a dense [N, K] matrix on the GPU.

Prefill multiplies many tokens by each weight, so it is compute-bound: the fastest product is
cuBLAS's tensor-core GEMM, and the cost of first expanding the weight to x's dtype (read half
a byte a weight, write two, read them again) is paid once for all the tokens of the batch.
kernels/w4a16_matmul.py does exactly that, a slice of rows at a time, as
kernels/gguf_matmul.py does for GGUF blocks.

Each program reads a [BLOCK_N, BLOCK_W] tile of packed words, each word once, with one
coalesced load, expands it in registers (kernels/w4a16.dequantize_words) and stores it as
[BLOCK_N, 8 * BLOCK_W] contiguous columns. A word's 8 columns lie in one group (group_size
>= 16), so the scales and zero points are read per word, not per weight.

The default launch, one row of 256 words a program with one warp, read and wrote 77-90% of
an H200's copy bandwidth at Llama-3.1-8B's projections (gpu_bench w4a16_kernel, 2026-11-29,
`loadtest/results/gpu_dequant_h200_run1.json`: qkv 19 µs, o 11, gate_up 82, down 42). The
kernel before it built the nibbles as a [BLOCK_N, BLOCK_W, 8] tile, which Triton moved
through shared memory with nine barriers a program; at its default of 16 rows x 64 words it
ran at 7-8% (gate_up 899 µs). With a perm, 2 rows x 128 words (64% against 42% for down).

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
from kernels.w4a16 import PACK, check_weight, dequantize_words, load_words


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
    w = dequantize_words(q, z, s, BLOCK_N, BLOCK_W)
    cols = tl.program_id(1) * (BLOCK_W * 8) + tl.arange(0, BLOCK_W * 8)
    if HAS_PERM:
        src = tl.load(perm_ptr + cols, mask=cols < WORDS * 8, other=0)
        w = tl.where((src >= 0)[None, :], w, 0.0)
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
    block_n: int | None = None,
    block_w: int | None = None,
    num_warps: int = 1,
) -> torch.Tensor:
    """The weight [n, k] of `dtype` from the int4 layout (kernels/w4a16.py); returns out.

    Column k is the weight's column k (the perm is not applied): dequantize_w4's result, with
    the perm's padding columns (-1) zero. qweight, scales, zeros, perm: the layout (contiguous
    last dimensions, any row strides). out (optional, written): [n, k] of `dtype`, rows of any
    stride. block_n, block_w: rows and packed words (8 columns each) per program, powers of two
    (default 1 x 256, and 2 x 128 with a perm, whose entries a program then reads for two rows).
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
    default_n, default_w = (1, 256) if perm is None else (2, 128)
    block_n = default_n if block_n is None else block_n
    block_w = default_w if block_w is None else block_w
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
