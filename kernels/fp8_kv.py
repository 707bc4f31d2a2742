"""8-bit float K/V: the two formats, and the one cast into them that every writer uses.

The pool stores K and V with a per-tensor scale of 1.0 (SGLang's default when a checkpoint
brings no calibrated scales): quantising is a cast, dequantising is a cast back to a wider
float, and the widenings the readers use (to fp16, bf16 or fp32) are all exact.

Saturation: a value beyond a format's largest finite value is clamped to it before the cast.
e4m3fn has no infinity (an overflowing cast gives NaN or 448 depending on torch's code path)
and e5m2 overflows to inf; either one in a key turns every score that reads it into NaN,
while a clamped outlier only distorts its own score. e5m2's range (57344) is rarely reached
by activations, but the clamp costs nothing and keeps both formats to one rule.

Indexing goes through byte views (`gather_kv`, `store_into`): torch's gather and scatter
kernels have lacked fp8 on some versions and devices, and moving bytes needs no arithmetic.

Plain torch (no Triton), so the CPU pool can import it; store_kv.py casts with it too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Fp8Format(NamedTuple):
    max: float  # the largest finite value; inputs are clamped to [-max, max]


FP8_FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e5m2: Fp8Format(57344.0),
    torch.float8_e4m3fn: Fp8Format(448.0),
}
FP8_KV_DTYPES = tuple(FP8_FORMATS)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x cast to a pool's dtype: saturating (see above) for fp8, a plain cast otherwise."""
    fmt = FP8_FORMATS.get(dtype)
    if fmt is None:
        return x.to(dtype)
    return x.float().clamp(-fmt.max, fmt.max).to(dtype)


def gather_kv(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buf[index] for any pool dtype (fp8 read as bytes)."""
    if buf.dtype in FP8_FORMATS:
        return buf.view(torch.uint8)[index].view(buf.dtype)
    return buf[index]


def store_into(buf: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
    """buf[index] = quantize_kv(x, buf.dtype), for any pool dtype (fp8 written as bytes)."""
    if buf.dtype in FP8_FORMATS:
        buf.view(torch.uint8)[index] = quantize_kv(x, buf.dtype).view(torch.uint8)
    else:
        buf[index] = x.to(buf.dtype)
