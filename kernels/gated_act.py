"""Activation-and-multiply of a fused gate/up projection: gate_up [n, 2 * d] (gate first) ->
act(gate) * up [n, d], in fp32 and rounded once. `silu_mul` (Llama's MLP and the others') and
`gelu_tanh_mul` (Gemma's) are one kernel with the activation chosen at compile time.

Grid: (n, cdiv(d, BLOCK)).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor, next_pow2
from kernels._math import tanh
from kernels.pdl import pdl_launch, pdl_prologue

_BLOCK = 1024
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@triton.jit
def _act_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    d,
    GELU_TANH: tl.constexpr,
    SQRT_2_OVER_PI: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (1.0 + tanh(inner)) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_mul(
    op: str, gate_up: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool
) -> torch.Tensor:
    check_tensor(op, "gate_up", gate_up, shape=(None, None), dims="[n, 2 * d]", dtypes=FLOAT_DTYPES)
    check_device(op, gate_up)
    n, width = gate_up.shape
    if width % 2:
        raise ValueError(f"{op}: gate_up's last dimension must be even (gate, up), got {width}")
    d = width // 2
    if out is None:
        out = torch.empty((n, d), dtype=gate_up.dtype, device=gate_up.device)
    check_tensor(
        op, "out", out, shape=(n, d), dims="[n, d]", dtypes=(gate_up.dtype,), device=gate_up.device
    )
    if n > 0 and d > 0:
        block = min(_BLOCK, next_pow2(d))
        _act_mul_kernel[(n, triton.cdiv(d, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            d,
            GELU_TANH=gelu_tanh,
            SQRT_2_OVER_PI=_SQRT_2_OVER_PI,
            BLOCK=block,
            num_warps=4,
            **pdl_launch(gate_up.device),
        )
    return out


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate_up[:, :d]) * gate_up[:, d:]; gate_up: [n, 2 * d] (any row stride).

    out (optional, written): [n, d] in gate_up's dtype. Returns out.
    """
    return _act_mul("silu_mul", gate_up, out, gelu_tanh=False)


def gelu_tanh_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate_up[:, :d]) * gate_up[:, d:], as silu_mul."""
    return _act_mul("gelu_tanh_mul", gate_up, out, gelu_tanh=True)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch twin of `silu_mul`, in fp32 and rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch twin of `gelu_tanh_mul`, in fp32 and rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)
