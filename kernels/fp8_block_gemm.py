"""w8a8 GEMM with block scales, for prefill over 128x128-block fp8 weights (DeepSeek-V3 and
Qwen3-FP8 layouts): out = (qa * sa) @ (qw * sw).T, fp8 operands on the tensor cores.

The activations come per token per 128 columns (kernels/fp8_act_quant.py, group 128), the
weight per 128x128 block, so each BLOCK_K = 128 step of the K loop has one activation scale
per row and one weight scale per output block: the fp8 tile product is accumulated in fp32
scaled by their outer product, and nothing is dequantized in memory.

Grid: (cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N),), grouped along m so neighbouring programs share
weight tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_launch, check_tensor, check_tile
from kernels.fp8_weights import BLOCK, FP8, dequantize


@triton.jit
def _block_gemm_kernel(
    a_ptr,
    w_ptr,
    sa_ptr,
    sw_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_sam,
    stride_swn,
    stride_om,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, SCALE_BLOCK)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    sa_ptrs = sa_ptr + offs_m.to(tl.int64) * stride_sam
    sw_ptrs = sw_ptr + (offs_n // SCALE_BLOCK).to(tl.int64) * stride_swn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, SCALE_BLOCK)):
        k_mask = offs_k < K - kb * SCALE_BLOCK
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb, mask=m_mask, other=0.0)
        sw = tl.load(sw_ptrs + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        a_ptrs += SCALE_BLOCK
        w_ptrs += SCALE_BLOCK
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int = 64,
    block_n: int = 128,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """(a * a_scale) @ (weight * w_scale).T in `out_dtype`, [m, n].

    a: [m, k] float8_e4m3fn (row stride any); a_scale: [m, ceil(k/128)] fp32, one per token
    per 128 columns; weight: [n, k] float8_e4m3fn; w_scale: [ceil(n/128), ceil(k/128)] fp32.
    block_m, block_n: the output tile (powers of two >= 16); each output column reads its
    own weight block's scale, so a tile may span several blocks.
    """
    op = "fp8_block_gemm"
    check_tensor(op, "a", a, shape=(None, None), dims="[m, k]", dtypes=(FP8,))
    check_device(op, a)
    m, k = a.shape
    kb = -(-k // BLOCK)
    check_tensor(
        op, "a_scale", a_scale, shape=(m, kb), dims="[m, ceil(k/128)]",
        dtypes=(torch.float32,), device=a.device,
    )  # fmt: skip
    check_tensor(
        op, "weight", weight, shape=(None, k), dims="[n, k]", dtypes=(FP8,), device=a.device
    )
    n = weight.shape[0]
    check_tensor(
        op, "w_scale", w_scale, shape=(-(-n // BLOCK), kb), dims="[ceil(n/128), ceil(k/128)]",
        dtypes=(torch.float32,), device=a.device,
    )  # fmt: skip
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be a 16 or 32-bit float, got {out_dtype}")
    check_tile(op, "block_m", block_m)
    check_tile(op, "block_n", block_n)
    check_launch(op, num_warps, num_stages)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_gemm_kernel[grid](
        a,
        weight,
        a_scale,
        w_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        a_scale.stride(0),
        w_scale.stride(0),
        out.stride(0),
        SCALE_BLOCK=BLOCK,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUP_M=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fp8_block_gemm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The torch twin of `fp8_block_gemm`: both operands dequantized in fp32."""
    x = a.float() * a_scale.repeat_interleave(BLOCK, dim=1)[:, : a.shape[1]]
    return (x @ dequantize(weight, w_scale, BLOCK).T).to(out_dtype)
