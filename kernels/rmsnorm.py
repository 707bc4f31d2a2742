"""RMSNorm with an optional fused residual add, one program per row.

Without a residual: out = w * rmsnorm(x). With one: s = x + residual, out = w * rmsnorm(s),
and s is returned as the new residual stream. The arithmetic follows
services/executor/models/layers.py's RMSNorm (HF Llama): mean of squares in fp32, the normed
row cast to x's dtype, then multiplied by the weight. A row lives in registers whole (it is
read completely before anything is written), so out may be x and residual_out may be
residual: in place.

With `unit_offset` (Gemma), the weight scales by 1 + w and the normed row stays in fp32 until
the one final rounding: out = (rmsnorm(x) * (1 + w)).to(dtype), as HF's Gemma norms compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
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
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
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

    x, residual, out, residual_out: [n, hidden] (any row stride); weight: [hidden].
    out (optional): may be x; its dtype is x's and weight's promotion, as in torch.
    residual_out (optional, only with residual): may be residual (or x); x's dtype.
    In a decoder layer: `h, res = rmsnorm(x, w, eps)` first, then
    `h, res = rmsnorm(attn_out, w2, eps, residual=res)`.
    """
    op = "rmsnorm"
    check_tensor(op, "x", x, shape=(None, None), dims="[n, hidden]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    n, hidden = x.shape
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
            residual_out = torch.empty_like(x)
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
        block = triton.next_power_of_2(hidden)
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
        x = x + residual
    x32 = x.float()
    normed32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        return (normed32 * (1.0 + weight.float())).to(out_dtype), x
    return weight * normed32.to(x.dtype), x
