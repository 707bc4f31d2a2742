"""x @ W.T for any number of rows, W kept as GGUF blocks (kernels/gguf_blocks.py).

Up to MAX_M rows (small decode batches) the product is bound by reading W, and
kernels/gguf_gemv reads only its blocks. Past that it is a GEMM, and for prefill's hundreds or
thousands of rows a compute-bound one: W is expanded to x's dtype by kernels/gguf_dequant a
slice of rows at a time into one scratch buffer of at most `chunk_elems` weights, and each
slice goes through cuBLAS (torch.mm) straight into its columns of out. The expansion costs
about 4 bytes a weight of extra traffic once per call, small beside the GEMM's arithmetic
from a few hundred rows of x up; the scratch bound keeps a 128K-vocabulary lm_head from
needing a full bf16 copy of itself.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.gemv import MAX_M
from kernels.gguf_blocks import check_blocks
from kernels.gguf_dequant import gguf_dequantize
from kernels.gguf_gemv import gguf_gemv

CHUNK_ELEMS = 1 << 25  # weights per dequantised slice: 64 MiB of bf16


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
    any row stride. chunk_elems: the most weights expanded at once (rounded up to one row).
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
    if m == 0 or n == 0:
        return out
    rows = max(1, min(n, chunk_elems // max(k, 1)))
    scratch = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = gguf_dequantize(blocks[n0:n1], qtype=qtype, k=k, dtype=x.dtype, out=scratch[: n1 - n0])
        torch.mm(x, w.T, out=out[:, n0:n1])
    return out
