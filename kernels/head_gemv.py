"""Per-head matrix-vector products for a few tokens: out[t, h, j] = sum_i x[t, h, i] W[h, i, j].

DeepSeek's absorbed latent attention multiplies every head's query by its own W_UK and every
head's attention output by its own W_UV (models/deepseek.py). At decode sizes a batched
matmul (torch.bmm) launches cuBLAS kernels with a split reduction, and the transposes and
concatenation around it add copies. Here one launch reads each head's weight once, takes any
strides (W_UK and W_UV are views of kv_b_proj's weight, one transposed), and writes straight
into a strided output (the query buffer's latent part, o_proj's input).

Grid: (tokens, heads, cdiv(J, BLOCK_J)); fp32 sums, rounded once, as bmm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor
from kernels.pdl import pdl_launch, pdl_prologue

MAX_TOKENS = 4  # past this, a batched tensor-core matmul reads the weights just as well

# The tiles of DeepSeek's two products (block_i, block_j, num_warps), from a sweep of every
# tiling at batch 1 with cold L2 (loadtest/results/gpu_head_gemv_h100_run1.json, H100,
# 2026-11-27; DeepSeek-V2-Lite's 16 heads and V3's 128, nope = v = 128, rank 512). Few
# programs' worth of work each, so small tiles and one warp: more programs in flight.
# q_nope @ W_UK (J = rank contiguous): V2-Lite 4.72 -> 2.66 us, V3 13.1 -> 7.66.
QUERY_TILES = (128, 16, 1)
# attn @ W_UV^T (I = rank contiguous): V2-Lite 5.51 -> 2.81 us, V3 8.46 -> 6.98.
OUTPUT_TILES = (256, 8, 1)


@triton.jit
def _head_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_i,
    num_j,
    stride_xt,
    stride_xh,
    stride_wh,
    stride_wi,
    stride_wj,
    stride_ot,
    stride_oh,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = offs_j < num_j
    x_row = x_ptr + tok * stride_xt + head * stride_xh
    w_head = w_ptr + head * stride_wh + offs_j[None, :] * stride_wj
    acc = tl.zeros([BLOCK_J], dtype=tl.float32)
    for i0 in range(0, num_i, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        i_mask = offs_i < num_i
        x = tl.load(x_row + offs_i, mask=i_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_head + offs_i[:, None] * stride_wi, mask=i_mask[:, None] & j_mask[None, :], other=0.0
        )
        acc += tl.sum(w.to(tl.float32) * x[:, None], axis=0)
    out = out_ptr + tok * stride_ot + head * stride_oh + offs_j
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=j_mask)


def head_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    block_i: int = 64,
    block_j: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """out[t, h, :] = x[t, h, :] @ weight[h] for every token t and head h; returns out.

    x: [tokens, heads, I] (last dim contiguous); weight: [heads, I, J], any strides; out:
    [tokens, heads, J] (last dim contiguous), written. All one dtype.
    """
    op = "head_gemv"
    check_tensor(op, "x", x, shape=(None, None, None), dims="[t, heads, I]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    tokens, heads, i = x.shape
    check_tensor(
        op,
        "weight",
        weight,
        shape=(heads, i, None),
        dims="[heads, I, J]",
        dtypes=(x.dtype,),
        device=x.device,
        last_contiguous=False,
    )
    j = weight.shape[2]
    check_tensor(op, "out", out, shape=(tokens, heads, j), dims="[t, heads, J]", dtypes=(x.dtype,))
    if tokens == 0:
        return out
    _head_gemv_kernel[(tokens, heads, triton.cdiv(j, block_j))](
        x, weight, out, i, j,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_I=block_i,
        BLOCK_J=block_j,
        num_warps=num_warps,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out


def head_gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch twin of `head_gemv`: [tokens, heads, J], fp32 sums rounded once."""
    return torch.einsum("thi,hij->thj", x.float(), weight.float()).to(x.dtype)
