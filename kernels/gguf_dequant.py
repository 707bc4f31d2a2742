"""Dequantise GGUF blocks (kernels/gguf_blocks.py) to a dense float matrix on the GPU.

Prefill multiplies many tokens by each weight, so it is compute-bound: the fastest product is
cuBLAS's tensor-core GEMM, and the cost of first expanding the weight to bf16 (read the
blocks, write 2 bytes a weight, read them again) is paid once for all the tokens of the
batch. kernels/gguf_matmul.py does exactly that, a slice of rows at a time.

The default launch, one row of 64 scale groups a program with two warps, read and wrote 86-88%
of an H200's copy bandwidth for Q4_K at Llama-3.1-8B's projections, 56-64% for Q6_K and
86-90% for Q8_0, against 69-75%, 39-44% and 64-73% with the earlier 16 rows x 16 groups and
four warps (a `.device` sweep of 12 launches, 2026-11-29).

Grid: (cdiv(n, BLOCK_N), cdiv(k / GROUP, GROUPS)); program (p, q) writes rows
p * BLOCK_N ... and scale groups q * GROUPS ... (GROUP weights each) of out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    INTERPRETER_BLOCK_N,
    check_device,
    check_tensor,
    interpreting,
)
from kernels.gguf_blocks import check_blocks, decode_groups, dequantize_ref


@triton.jit
def _dequant_kernel(
    w_ptr,
    out_ptr,
    N,
    NUM_GROUPS,
    stride_wn,
    stride_on,
    QTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gi = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    mask = (offs_n < N)[:, None] & (gi < NUM_GROUPS)[None, :]
    rows = offs_n.to(tl.int64)
    w = decode_groups(w_ptr, rows * stride_wn, gi, mask, QTYPE, GROUP)
    cols = gi[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    dst = out_ptr + (rows * stride_on)[:, None, None] + cols
    tl.store(dst, w.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])


def gguf_dequantize(
    blocks: torch.Tensor,
    *,
    qtype: str,
    k: int,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    groups: int = 64,
    num_warps: int = 2,
) -> torch.Tensor:
    """Weights [n, k] of `dtype` from GGUF blocks [n, row bytes] of `qtype`; returns out.

    out (optional, written): [n, k] of `dtype`, rows of any stride.
    block_n, groups: rows and scale groups per program (powers of two; block_n None: 1, or
    INTERPRETER_BLOCK_N in Triton's CPU interpreter, which runs programs one after another at a
    cost that hardly depends on their size); num_warps: the launch's.
    """
    op = "gguf_dequantize"
    check_device(op, blocks)
    lay = check_blocks(op, blocks, qtype, k)
    n = blocks.shape[0]
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be a float dtype, got {dtype}")
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=blocks.device)
    check_tensor(op, "out", out, shape=(n, k), dims="[n, k]", dtypes=(dtype,), device=blocks.device)
    if block_n is None:
        block_n = INTERPRETER_BLOCK_N if interpreting() else 1
    for name, size in (("block_n", block_n), ("groups", groups)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{op}: {name} must be a power of two, got {size}")
    if n == 0 or k == 0:
        return out
    num_groups = k // lay.group
    grid = (triton.cdiv(n, block_n), triton.cdiv(num_groups, groups))
    _dequant_kernel[grid](
        blocks,
        out,
        n,
        num_groups,
        blocks.stride(0),
        out.stride(0),
        QTYPE=lay.type_id,
        GROUP=lay.group,
        BLOCK_N=block_n,
        GROUPS=groups,
        num_warps=num_warps,
    )
    return out


def gguf_dequantize_ref(blocks: torch.Tensor, *, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """The torch twin of `gguf_dequantize`: fp32 weights rounded once to `dtype`."""
    return dequantize_ref(blocks, qtype).to(dtype)
