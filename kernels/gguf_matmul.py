"""x @ W.T for any number of rows, W kept as GGUF blocks (kernels/gguf_blocks.py).

Two regimes, by the rows m of x:
- m <= MAX_M (small decode batches): bound by reading W; kernels/gguf_gemv reads only its
  blocks and keeps every row's sums in registers.
- past that (larger decode batches, prefill): W is expanded to x's dtype by
  kernels/gguf_dequant a slice of rows at a time into one scratch buffer of at most
  `chunk_elems` weights, and each slice goes through cuBLAS (kernels/expand_mm). The
  expansion's extra ~4 bytes a weight are paid once for all the rows.
A dequantising tensor-core GEMM took the rows from 5 to 31 until 2026-11-29, when it lost to
expanding on every projection of Llama-3.1-8B at every row count from 4 to 32 on an H200
(`loadtest/results/gpu_small_m_h200_run1.json`, cold weights, µs for qkv + o + gate_up +
down, the weight expanded whole for one cuBLAS product): Q4_K 491 against 274 at 5 to 16
rows, Q6_K 770 against 362; down alone 218 against 76 (Q4_K). Expanding in slices, as here,
cost int4 4% more than whole in the next measurement. The GEMM had been measured on gate_up
alone, where the two tie. It was removed.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.expand_mm import CHUNK_ELEMS, expand_mm
from kernels.gemv import MAX_M
from kernels.gguf_blocks import check_blocks
from kernels.gguf_dequant import gguf_dequantize
from kernels.gguf_gemv import gguf_gemv


def gguf_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    *,
    qtype: str,
    out: torch.Tensor | None = None,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """x @ W.T, W [n, k] given as GGUF blocks [n, row bytes] of `qtype`; returns out.

    x: [m, k], a float dtype (contiguous rows); out (optional, written): [m, n] of x's dtype,
    any row stride. chunk_elems: the most weights expanded at once past MAX_M rows (rounded up
    to one row).
    """
    op = "gguf_matmul"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if 1 <= m <= MAX_M:
        return gguf_gemv(x, blocks, qtype=qtype, out=out)
    check_blocks(op, blocks, qtype, k, device=x.device)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    return expand_mm(
        x,
        out,
        lambda n0, n1, buf: gguf_dequantize(
            blocks[n0:n1], qtype=qtype, k=k, dtype=x.dtype, out=buf
        ),
        chunk_elems=chunk_elems,
    )
