"""fp8 tiles widened to fp16 in registers, as the load returns them, before any layout change.

Triton widens a tile (`x.to(tl.float16)`) feeding tl.dot only after it has taken the tile out
of shared memory in the dot's operand layout, so shared memory keeps the 8-bit elements. That
saves shared memory but costs the operand whose reduction axis is not the tile's contiguous
one (V in attention's P @ V): ldmatrix's transposing form takes 16-bit elements only (sm_90),
so the 8-bit tile reaches the MMAs through one scalar shared load per byte (128 a thread per
32 x 512 tile in decode attention's stage 1, against 16 ldmatrix for a 16-bit tile).

`widen_early` converts with inline PTX, which Triton does not move past the layout change:
the tile goes to shared memory as fp16 and is read back transposed by ldmatrix. Both formats
widen exactly: e5m2 is fp16's top byte (a byte permute), e4m3 goes through sm_89's cvt.

Inline PTX runs on NVIDIA GPUs only: callers gate it with a constexpr that is off under the
interpreter (kernels._checks.interpreting), where they widen with `.to` as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._checks import interpreting

# Each output register holds two fp16: bytes (zero, x0, zero, x1) and (zero, x2, zero, x3) of
# the four packed e5m2 inputs, x0 the lowest.
_E5M2_ASM: tl.constexpr = tl.constexpr("prmt.b32 $0, $2, 0, 0x1404;\n\tprmt.b32 $1, $2, 0, 0x3424;")
_E4M3_ASM: tl.constexpr = tl.constexpr(
    "{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, $2;\n\t"
    "cvt.rn.f16x2.e4m3x2 $0, lo;\n\tcvt.rn.f16x2.e4m3x2 $1, hi;\n\t}"
)


@triton.jit
def widen_early(x, E5M2: tl.constexpr):
    """fp8 tile `x` as fp16, converted where it is (see the module docstring)."""
    # Not pure: a pure elementwise op would be moved past the layout change like `.to`.
    if E5M2:
        y = tl.inline_asm_elementwise(
            _E5M2_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], tl.float16, False, 4
        )
    else:
        y = tl.inline_asm_elementwise(
            _E4M3_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], tl.float16, False, 4
        )
    return y


def early_widening(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel reading `dtype` tiles on `device` can use `widen_early`: not in the
    interpreter, and e4m3 only from compute capability 8.9 (its cvt)."""
    if dtype not in (torch.float8_e5m2, torch.float8_e4m3fn) or interpreting():
        return False
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        return _e4m3_cvt(device)
    return True


@functools.cache
def _e4m3_cvt(device: torch.device) -> bool:
    """Whether `device` has the e4m3 cvt (compute capability 8.9+): asked by every layer's
    eager decode, so looked up once per device."""
    return torch.cuda.get_device_capability(device) >= (8, 9)
