"""x @ W.T for prefill where W is kept compressed (GGUF blocks, int4): W expanded to x's dtype
a slice of output rows at a time into one scratch buffer, each slice multiplied by cuBLAS
(torch.mm) straight into its columns of out.

Past a few dozen rows of x the product is compute-bound, and cuBLAS's GEMM is the fastest
there is at these sizes; expanding W first costs about 4 bytes of traffic a weight (write
it, read it back), paid once for all the rows. The scratch bound (`chunk_elems` weights)
keeps a large projection (a 128K-vocabulary lm_head, an MLP's fused gate_up) from needing a
full 16-bit copy of itself. kernels/gguf_matmul.py and kernels/w4a16_matmul.py route their
prefill rows here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_ELEMS = 1 << 25  # weights per expanded slice: 64 MiB of bf16
# A slice's first row is a multiple of this when the weight takes more than one slice, so
# that each product writes a column range of out starting on a 256-byte boundary. With
# slices of whatever rows fitted (Llama-3.1-8B's down projection: 2,340 and 1,756 rows)
# the second product's columns started off even a 16-byte one.
SLICE_ALIGN = 128

# expand(n0, n1, buf): writes W's rows [n0, n1) into buf ([n1 - n0, k], x's dtype) and
# returns the expanded rows (buf itself, or a view of it)
Expand = Callable[[int, int, torch.Tensor], torch.Tensor]


def expand_mm(
    x: torch.Tensor,
    out: torch.Tensor,
    expand: Expand,
    *,
    chunk_elems: int = CHUNK_ELEMS,
    row_align: int = 1,
) -> torch.Tensor:
    """out = x @ W.T, W [n, k] given by `expand`, a slice of at most `chunk_elems` weights
    (rounded up to one row; down to SLICE_ALIGN rows where there are several) at a time;
    returns out. row_align: every slice but the last a multiple of these rows (at least
    one multiple: a tile of the weight's storage, say).

    x: [m, k] (checked by the caller); out: [m, n] of x's dtype, any row stride."""
    m, k = x.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return out
    rows = max(1, min(n, chunk_elems // max(k, 1)))
    if rows < n and rows >= SLICE_ALIGN:
        rows -= rows % SLICE_ALIGN
    if rows < n:
        rows = max(row_align, rows - rows % row_align)
    scratch = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = expand(n0, n1, scratch[: n1 - n0])
        torch.mm(x, w.T, out=out[:, n0:n1])
    return out
