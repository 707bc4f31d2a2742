"""GELU(tanh)-and-multiply, Gemma's gated MLP: gate_up [n, 2 * d] (gate first, as a fused
gate/up projection lays it out) -> gelu_tanh(gate) * up [n, d], in fp32 and rounded once.

Grid: (n, cdiv(d, BLOCK)).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels._math import tanh

_BLOCK = 1024
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@triton.jit
def _gelu_tanh_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, d, SQRT_2_OVER_PI: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    inner = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    out = 0.5 * gate * (1.0 + tanh(inner)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate_up[:, :d]) * gate_up[:, d:]; gate_up: [n, 2 * d] (any row stride).

    out (optional, written): [n, d] in gate_up's dtype. Returns out.
    """
    op = "gelu_tanh_mul"
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
        block = min(_BLOCK, triton.next_power_of_2(d))
        _gelu_tanh_mul_kernel[(n, triton.cdiv(d, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            d,
            SQRT_2_OVER_PI=_SQRT_2_OVER_PI,
            BLOCK=block,
            num_warps=4,
        )
    return out


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch twin of `gelu_tanh_mul`, in fp32 and rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)
