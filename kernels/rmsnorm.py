"""RMSNorm with an optional fused residual add, one program per row.

Without a residual: out = w * rmsnorm(x). With one: s = x + residual, out = w * rmsnorm(s),
and s is returned as the new residual stream. The arithmetic follows
services/executor/models/layers.py's RMSNorm (HF Llama): mean of squares in fp32, the normed
row cast to x's dtype, then multiplied by the weight. A row lives in registers whole (it is
read completely before anything is written), so out may be x and residual_out may be
residual: in place.

With `unit_offset` (Gemma), the weight scales by 1 + w and the normed row stays in fp32 until
the one final rounding: out = (rmsnorm(x) * (1 + w)).to(dtype), as HF's Gemma norms compute.

With a residual, x may be [n, k, hidden]: each token's k rows (a MoE layer's per-expert
outputs, kernels/fused_moe.py with reduce=False) are summed first, in fp32 and rounded once
as fused_moe's own sum rounds them, so the top-k sum costs no launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor, next_pow2
from kernels.pdl import pdl_launch, pdl_prologue

_MAX_HIDDEN = 65536  # one row per program, whole in registers


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    SUM_ROWS: tl.constexpr,  # rows of x per token, summed first (1: x as it is)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    if SUM_ROWS == 1:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    else:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(SUM_ROWS):
            part = tl.load(x_ptr + row * stride_x + j * hidden + offs, mask=mask, other=0.0)
            total += part.to(tl.float32)
        x = total.to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        # Rounded to x's dtype as `x + residual` in torch would be.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if UNIT_OFFSET:
        out = (x32 * rstd) * (w.to(tl.float32) + 1.0)
    else:
        normed = (x32 * rstd).to(x_ptr.dtype.element_ty)
        out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, new_residual): (w * rmsnorm(x), x) or, with residual,
    (w * rmsnorm(x + residual), x + residual); with unit_offset, 1 + w in place of w (Gemma).

    x, residual, out, residual_out: [n, hidden] (any row stride); weight: [hidden]. With a
    residual, x may also be [n, k, hidden] (contiguous k rows of each token): their sum is
    the x above.
    out (optional): may be x; its dtype is x's and weight's promotion, as in torch.
    residual_out (optional, only with residual): may be residual (or x); x's dtype.
    In a decoder layer: `h, res = rmsnorm(x, w, eps)` first, then
    `h, res = rmsnorm(attn_out, w2, eps, residual=res)`.
    """
    op = "rmsnorm"
    sum_rows = 1
    if x.dim() == 3 and residual is not None:
        dims = "[n, k, hidden]"
        check_tensor(op, "x", x, shape=(None, None, None), dims=dims, dtypes=FLOAT_DTYPES)
        n, sum_rows, hidden = x.shape
        if x.stride(2) != 1 or x.stride(1) != hidden:
            raise ValueError(f"{op}: x [n, k, hidden] must have contiguous k rows of each token")
    else:
        check_tensor(op, "x", x, shape=(None, None), dims="[n, hidden]", dtypes=FLOAT_DTYPES)
        n, hidden = x.shape
    check_device(op, x)
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {hidden} is over the supported {_MAX_HIDDEN}")
    dev = x.device
    check_tensor(
        op, "weight", weight, shape=(hidden,), dims="[hidden]", dtypes=FLOAT_DTYPES, device=dev
    )
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty((n, hidden), dtype=out_dtype, device=dev)
    check_tensor(
        op, "out", out, shape=(n, hidden), dims="[n, hidden]", dtypes=(out_dtype,), device=dev
    )
    if residual is None:
        if residual_out is not None:
            raise ValueError(f"{op}: residual_out needs a residual")
        res_arg, res_out = x, x  # unused by the kernel
    else:
        check_tensor(
            op,
            "residual",
            residual,
            shape=(n, hidden),
            dims="[n, hidden]",
            dtypes=(x.dtype,),
            device=dev,
        )
        if residual_out is None:
            residual_out = torch.empty((n, hidden), dtype=x.dtype, device=dev)
        check_tensor(
            op,
            "residual_out",
            residual_out,
            shape=(n, hidden),
            dims="[n, hidden]",
            dtypes=(x.dtype,),
            device=dev,
        )
        res_arg, res_out = residual, residual_out
    if n > 0:
        block = next_pow2(hidden)
        _rmsnorm_kernel[(n,)](
            x,
            res_arg,
            weight,
            out,
            res_out,
            x.stride(0),
            res_arg.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            UNIT_OFFSET=unit_offset,
            SUM_ROWS=sum_rows,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **pdl_launch(x.device),
        )
    return out, (x if residual is None else res_out)


def rmsnorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `rmsnorm` (out-of-place), written as layers.RMSNorm (or, with
    unit_offset, models/gemma.py's GemmaRMSNorm) computes it."""
    if residual is not None:
        if x.dim() == 3:  # a token's rows summed as kernels/fused_moe's sum does
            x = x.float().sum(1).to(x.dtype)
        x = x + residual
    x32 = x.float()
    normed32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        return (normed32 * (1.0 + weight.float())).to(out_dtype), x
    return weight * normed32.to(x.dtype), x
