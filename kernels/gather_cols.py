"""x's columns through an act-order perm, once per product: out[m, k] = x[m, perm[k]], and 0
where perm[k] is -1 (the zero-weight padding columns of kernels/w4a16.py's act-order layout).

A GPTQ checkpoint with act-order (desc_act) stores its weight's input channels sorted by
group; the int4 kernels read the weight in that order and need x in it too. Gathering x's
columns inside the GEMV cost a 2-byte load per column at scattered addresses (a warp's load
touching up to 32 cache lines, where the plain path reads a word's 8 columns in one 8-byte
load), and masks on every step. One launch here writes the gathered rows (m x K elements,
a few KiB at decode), after which the product runs the plain path; vLLM's GPTQ Marlin
kernels take act-order the same way, x permuted before the product.

Grid: (m, cdiv(K, BLOCK)); PDL-aware, as it sits in a decode step's chain of launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.pdl import pdl_launch, pdl_prologue

BLOCK = 1024


@triton.jit
def _gather_cols_kernel(
    x_ptr, perm_ptr, out_ptr, K, stride_xm, stride_om, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_k = ks < K
    src = tl.load(perm_ptr + ks, mask=in_k, other=-1)
    x = tl.load(x_ptr + row * stride_xm + src, mask=src >= 0, other=0.0)
    tl.store(out_ptr + row * stride_om + ks, x, mask=in_k)


def gather_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """[m, K] with column k = x[:, perm[k]], or 0 where perm[k] < 0.

    x: [m, k_in] float, any row stride (unit column stride); perm: int32 [K] on x's device,
    entries in [-1, k_in) (not checked on the host: that would read the tensor; the loader
    builds perms, kernels/w4a16.py's layout). Returns a new contiguous tensor of x's dtype.
    """
    op = "gather_columns"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k_in]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    check_tensor(
        op, "perm", perm, shape=(None,), dims="[K]", dtypes=(torch.int32,), device=x.device
    )
    m, k = x.shape[0], perm.shape[0]
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0 or k == 0:
        return out
    _gather_cols_kernel[(m, triton.cdiv(k, BLOCK))](
        x, perm, out, k, x.stride(0), out.stride(0), BLOCK=BLOCK, **pdl_launch(x.device)
    )
    return out


def gather_columns_ref(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The torch twin of gather_columns."""
    real = perm >= 0
    out = torch.zeros((x.shape[0], perm.shape[0]), dtype=x.dtype, device=x.device)
    out[:, real] = x[:, perm[real].long()]
    return out
