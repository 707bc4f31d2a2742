"""The mixture-of-experts MLP for a decode step of a few tokens, as two matrix-vector launches.

At batch 1 to MAX_TOKENS each chosen expert sees one token or two, and the step is bound by
reading the chosen experts' weights once. kernels/fused_moe.py's grouped GEMM needs its
tokens sorted by expert first (kernels/moe_align.py) and its per-pair products summed after
(a third launch): three of its five launches do no reading of weights at all, and each costs
a few microseconds at this size, 48 layers a step. Here the (token, slot) pairs index the
experts directly, so nothing is sorted, and the top-k sum happens in registers:

1. gate_up, grid (pairs, cdiv(I, BLOCK_N)): program (p, j) streams rows [j * BLOCK_N, ...) of
   expert ids[p]'s gate and up weights against x[p // top_k], writes silu(gate) * up: [pairs, I].
2. down, grid (tokens, cdiv(hidden, BLOCK_N)): program (t, j) takes rows [j * BLOCK_N, ...) of
   the down weight of each of token t's top_k experts in turn, against that pair's row of (1),
   and sums them weighted by the routing weights: [tokens, hidden].

Rounding follows the grouped GEMM path (fused_moe_ref): the activation and each weighted
per-expert product are rounded to x's dtype, the top-k sum is taken in fp32 and rounded once.
Shapes depend only on (tokens, top_k), never on the routing: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue

MAX_TOKENS = 4  # past this, experts see several tokens each and the grouped GEMM reads less


@triton.jit
def _moe_gate_up_gemv_kernel(
    x_ptr,  # [tokens, K]
    w13_ptr,  # [experts, 2 * N, K]: gate rows, then up rows
    act_ptr,  # [pairs, N]
    ids_ptr,  # [pairs]
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    gate_rows = w13_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        gate = tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_gate += tl.sum(gate * x, axis=1)
        acc_up += tl.sum(up * x, axis=1)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = act_ptr + pair.to(tl.int64) * stride_am + offs_n
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_down_gemv_kernel(
    act_ptr,  # [pairs, K]
    w2_ptr,  # [experts, N, K]
    out_ptr,  # [tokens, N]
    ids_ptr,  # [pairs]
    weights_ptr,  # [pairs] fp32
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = tok * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        rows = w2_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        act_row = act_ptr + pair * stride_am
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(act_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        weighted = acc * tl.load(weights_ptr + pair)
        total += weighted.to(dtype).to(tl.float32)  # rounded per expert, as the grouped path
    tl.store(out_ptr + tok * stride_om + offs_n, total.to(dtype), mask=n_mask)


def moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_n: int = 8,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """fused_moe's product in two launches, for decode batches (fused_moe takes it for at most
    MAX_TOKENS tokens); arguments as fused_moe's, checked there (it is the entry point).
    block_n, block_k: output rows per program and weight columns per step (powers of two)."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    if tokens < 1:
        raise ValueError("moe_gemv: x must have a row")
    pairs = tokens * top_k
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    launch = dict(
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages
    )
    _moe_gate_up_gemv_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, w13, act, ids, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        **launch,
        **pdl_launch(x.device),
    )  # fmt: skip
    _moe_down_gemv_kernel[(tokens, triton.cdiv(hidden, block_n))](
        act, w2, out, ids, weights, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        **launch,
        **pdl_launch(act.device),
    )  # fmt: skip
    return out
