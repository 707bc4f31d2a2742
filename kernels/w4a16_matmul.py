"""x @ w.T for any number of rows, w int4 in the layout of kernels/w4a16.py (AWQ and GPTQ).

Three regimes, by the rows m of x, as kernels/gguf_matmul.py has them for GGUF blocks:
- m <= MAX_M (small decode batches): kernels/w4a16_gemv, bound by reading w.
- m <= gemm_max_m (larger decode batches, short extends): kernels/w4a16_gemm multiplies the
  packed words on the tensor cores, reading them once per tile of up to 64 rows of x.
- past that (prefill): compute-bound, where the Triton GEMM runs at a small share of
  cuBLAS's speed (12 to 31 times bf16 cuBLAS's time at 128 and 2,048 rows of Llama-3.1-8B's
  projections on an H200). w is expanded to x's dtype by kernels/w4a16_dequant a slice of
  rows at a time, each slice through cuBLAS (kernels/expand_mm).

On a GPU with the MMA (compute capability 8.0 and newer) an int4 projection keeps its words
shuffled for kernels/w4a16_mma instead (services/executor/quant/int4_linear.py), and
`w4a16_mma_matmul` routes its products: the MMA up to 64 rows, past that the shuffled words
expanded by kernels/w4a16_mma_dequant for cuBLAS. The plain layout's GEMV and GEMM remain for
shapes the MMA does not take (groups under 64 columns, N not a multiple of 16).

Act-order: x's columns are gathered into the weight's column order once per call
(kernels/gather_cols.py, m x K elements, small beside the m x n x K product), padding
columns (perm -1) as 0, and whichever product runs reads the plain layout: the padding
columns' weights are finite, so what they add is 0. Folding the perm into the weight instead
(each dequantised column stored at x's column) would scatter the expansion's stores across
each row, where the gather of x is one small launch.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels.expand_mm import CHUNK_ELEMS, expand_mm
from kernels.gather_cols import gather_columns
from kernels.gemv import MAX_M
from kernels.w4a16 import check_w4
from kernels.w4a16_dequant import w4a16_dequantize
from kernels.w4a16_gemm import w4a16_gemm
from kernels.w4a16_gemv import w4a16_gemv
from kernels.w4a16_mma import MAX_M as MMA_MAX_M
from kernels.w4a16_mma import mma_block, mma_fits, split_at_most, w4a16_mma
from kernels.w4a16_mma_dequant import w4a16_mma_dequantize

# The most rows the tensor-core GEMM takes; from GEMM_MAX_M + 1 rows, dequantise + cuBLAS.
# Measured on an H200 (Llama-3.1-8B's four projections, cold weights, µs summed;
# loadtest/results/gpu_w4a16_join_h200_run1.json and gpu_w4a16_bigm_h200_run1.json): 8 rows
# 131.5 against 292.0 for dequantise + cuBLAS, 32 rows 169.3 against 296.1, 48 rows 231.7
# against 300.7, 64 rows 239.3 against 301.9, 96 rows 411.6 against 315.1 (bf16 cuBLAS
# 127-135 at these rows).
GEMM_MAX_M = 64


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gemm_max_m: int = GEMM_MAX_M,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """x @ w.T (x's columns through `perm` when given), w in the int4 layout; returns out.

    x: [m, k_in], a float dtype, any row stride; qweight, scales, zeros, perm: the layout
    (kernels/w4a16.py). out (optional, written): [m, n] of x's dtype, any row stride.
    gemm_max_m: the most rows given to the tensor-core GEMM; chunk_elems: the most weights
    dequantised at once past that (rounded up to one row).
    """
    op = "w4a16_matmul"
    m, n, _ = check_w4(op, x, qweight, scales, zeros, group_size, perm)
    if perm is not None:
        x = gather_columns(x, perm)
    if 1 <= m <= MAX_M:
        return w4a16_gemv(x, qweight, scales, zeros, group_size=group_size, out=out)
    if m <= gemm_max_m:
        return w4a16_gemm(x, qweight, scales, zeros, group_size=group_size, out=out)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)

    def dequantize(n0: int, n1: int, buf: torch.Tensor) -> torch.Tensor:
        return w4a16_dequantize(
            qweight[n0:n1], scales[n0:n1], zeros[n0:n1],
            group_size=group_size, dtype=x.dtype, out=buf,
        )  # fmt: skip

    return expand_mm(x, out, dequantize, chunk_elems=chunk_elems)


def w4a16_mma_matmul(
    x: torch.Tensor,
    qmma: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    chunk_elems: int = CHUNK_ELEMS,
    split: int | None = None,
    ahead: int | None = None,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ w.T (x's columns through `perm` when given), w's words shuffled for the MMA
    (kernels/w4a16_mma.shuffle_w4, which a GPU keeps in place of the plain layout); returns
    out. Up to the MMA's 64 rows (decode batches, short extends) kernels/w4a16_mma, past that
    the weight expanded a slice of rows at a time (kernels/w4a16_mma_dequant) for cuBLAS.

    x: [m, k_in] bf16/fp16, any row stride; qmma int32 [n / 16, k / 64, 32, 4]; scales, zeros,
    perm: the layout (kernels/w4a16.py). out (optional, written): [m, n] of x's dtype, any row
    stride (contiguous columns). split: the MMA's warps a tile (a launch the start-up timing
    chose; lowered to what k's groups allow), None: its default; ahead: the MMA's chunks of
    words in flight (`w4a16_mma`). mins: float mins in place of the zero points (zeros None;
    w = s q - m: GGUF's Q4_K, kernels/gguf_q4k_mma.py)."""
    op = "w4a16_mma_matmul"
    n = qmma.shape[0] * 16
    if perm is not None:
        x = gather_columns(x, perm)
    m, k = x.shape
    if m <= MMA_MAX_M:
        if not mma_fits(x, n, k, group_size):  # a strided or misaligned view: a copy
            x = x.clone(memory_format=torch.contiguous_format)
        if split is not None:
            split = split_at_most(k, mma_block(k, group_size), split)
        return w4a16_mma(x, qmma, scales, zeros, group_size=group_size, out=out, split=split,
                         ahead=ahead, mins=mins)  # fmt: skip
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)

    def dequantize(n0: int, n1: int, buf: torch.Tensor) -> torch.Tensor:
        return w4a16_mma_dequantize(
            qmma[n0 // 16 : n1 // 16], scales[n0:n1], None if zeros is None else zeros[n0:n1],
            group_size=group_size, dtype=x.dtype, out=buf,
            mins=None if mins is None else mins[n0:n1],
        )  # fmt: skip

    return expand_mm(x, out, dequantize, chunk_elems=chunk_elems, row_align=16)
