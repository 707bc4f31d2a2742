"""Activations quantized to fp8 for the w8a8 GEMMs: each token's row, or each group of `group`
columns of it, divided by its own scale (its largest |x| / 448) and cast to float8_e4m3fn.

Per token (group 0) feeds torch._scaled_mm's row-wise scales [m, 1]; groups of 128 feed the
block-scale GEMM (kernels/fp8_block_gemm.py), whose K steps are the weight's 128-column
blocks. A static scale (a checkpoint's calibrated `input_scale`) skips the max.

Grid: (m, groups); a program reads its columns twice (max, then cast), BLOCK at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor, next_pow2
from kernels.fp8_weights import FP8, FP8_MAX

_TINY = 1e-12  # the scale of an all-zero group


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), in fp32: the
    cast that follows is then exact whatever its own rounding (Triton's CPU interpreter
    drops the carry when rounding up into the next power of two: 126.6 became 64).
    Adding then subtracting c = 2^(e + 20) rounds |v| in [2^e, 2^(e+1)) to a multiple of
    2^(e - 3), e4m3's spacing there (at least 2^-9, its subnormals' spacing)."""
    a = tl.abs(v)
    e_bits = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, (127 - 6) << 23)
    c = (e_bits + (20 << 23)).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_act_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    K,
    group,
    stride_xm,
    stride_qm,
    stride_sm,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * group
    hi = tl.minimum(lo + group, K)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < hi, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(s_ptr + row * stride_sm + g, scale)
    for k0 in range(lo, hi, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < hi, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(x / scale, -448.0, 448.0))
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < hi)


def quantize_act(
    x: torch.Tensor, *, group: int = 0, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [m, k] float8_e4m3fn, scales [m, groups] fp32) with x ~ q * scale per group.

    x: [m, k] float, any row stride. group: columns per scale (0: the whole row, one scale
    per token). static_scale: [1] fp32, the one scale of every token (then group must be 0).
    """
    op = "quantize_act"
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k = x.shape
    if group < 0:
        raise ValueError(f"{op}: group must be 0 (per token) or positive, got {group}")
    if static_scale is not None:
        if group:
            raise ValueError(f"{op}: a static scale is per token (group 0), got group {group}")
        check_tensor(
            op, "static_scale", static_scale, shape=(1,), dims="[1]", dtypes=(torch.float32,),
            device=x.device,
        )  # fmt: skip
    size = group or max(k, 1)
    groups = -(-k // size)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    block = min(1024, next_pow2(size))
    _quantize_act_kernel[(m, groups)](
        x,
        q,
        scales,
        scales if static_scale is None else static_scale,
        k,
        size,
        x.stride(0),
        q.stride(0),
        scales.stride(0),
        STATIC=static_scale is not None,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )
    return q, scales


def quantize_act_ref(
    x: torch.Tensor, *, group: int = 0, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `quantize_act`."""
    m, k = x.shape
    size = group or max(k, 1)
    groups = -(-k // size)
    x32 = torch.zeros(m, groups * size, device=x.device)
    x32[:, :k] = x.float()
    if static_scale is not None:
        scales = static_scale.float().expand(m, 1).clone()
    else:
        amax = x32.view(m, groups, size).abs().amax(dim=2)
        scales = (amax / FP8_MAX).clamp(min=_TINY)
    per_col = scales.repeat_interleave(size, dim=1)[:, :k]
    q = (x.float() / per_col).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales
