"""x @ W.T for any number of rows, W kept as GGUF blocks (kernels/gguf_blocks.py).

Three regimes, by the rows m of x:
- m <= MAX_M (small decode batches): bound by reading W; kernels/gguf_gemv reads only its
  blocks and keeps every row's sums in registers.
- m <= gemm_max_m (larger decode batches, short extends): still bound by reading W;
  kernels/gguf_gemm decodes tiles of W in registers for tensor cores, reading the blocks once
  per 16 to 64 rows of x.
- past that (prefill): compute-bound. W is expanded to x's dtype by kernels/gguf_dequant a
  slice of rows at a time into one scratch buffer of at most `chunk_elems` weights, and each
  slice goes through cuBLAS (kernels/expand_mm): cuBLAS's GEMM is the fastest there is at
  these sizes, and the expansion's extra ~4 bytes a weight, paid once for all the rows, is
  small beside the arithmetic of hundreds of rows.
GEMM_MAX_M is where gpu_bench's gguf_kernel section finds them crossing: Q4_K's gate_up on an
H200 (2026-11-29, `loadtest/results/gpu_dequant_h200_run1.json`), the GEMM 148 µs at 8 and
16 rows against 153 and 154 for expanding, and from 32 rows the expansion (32: 156 against
196; 256: 184 against 535). It was 256 before, set by arithmetic, while the same section had
measured the crossover at 32 on 2026-11-26.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.expand_mm import CHUNK_ELEMS, expand_mm
from kernels.gemv import MAX_M
from kernels.gguf_blocks import check_blocks
from kernels.gguf_dequant import gguf_dequantize
from kernels.gguf_gemm import gguf_gemm
from kernels.gguf_gemv import gguf_gemv

GEMM_MAX_M = 31


def gguf_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    *,
    qtype: str,
    out: torch.Tensor | None = None,
    gemm_max_m: int = GEMM_MAX_M,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """x @ W.T, W [n, k] given as GGUF blocks [n, row bytes] of `qtype`; returns out.

    x: [m, k], a float dtype (contiguous rows); out (optional, written): [m, n] of x's dtype,
    any row stride. gemm_max_m: the most rows given to the dequantising GEMM; chunk_elems: the
    most weights expanded at once past that (rounded up to one row).
    """
    op = "gguf_matmul"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if 1 <= m <= MAX_M:
        return gguf_gemv(x, blocks, qtype=qtype, out=out)
    if m <= gemm_max_m:
        return gguf_gemm(x, blocks, qtype=qtype, out=out)
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
