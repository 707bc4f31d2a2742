"""MoE top-k routing in one launch: router logits [tokens, experts] -> each token's top_k
experts and weights, for the plain ("greedy") routing of Qwen2/3-MoE, Mixtral and
DeepSeek-V2-Lite: softmax or sigmoid scores in fp32, the top_k by repeated argmax
(descending), optionally renormalised to sum 1, times a scale.

torch does this in five or six small kernels (cast, softmax, topk, sum, divide); a decode
step pays them in every layer. The twin is services/executor/models/moe_routing.py's
select_experts (greedy), which the tests compare with.

Grid: (tokens,); one program holds a token's whole row of scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_device, check_tensor, next_pow2
from kernels.pdl import pdl_launch, pdl_prologue

_SCORINGS = ("softmax", "sigmoid")


@triton.jit
def _moe_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l,
    scale,
    TOP_K: tl.constexpr,
    EXTRA: tl.constexpr,  # slots after the top_k: experts num_experts + j, weight 1
    K_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALISE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_BLOCK)
    e_mask = e < num_experts
    x = tl.load(logits_ptr + row * stride_l + e, mask=e_mask, other=float("-inf"))
    x = x.to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(e_mask, p, 0.0)
        scores = p / tl.sum(p, 0)
    scores = tl.where(e_mask, scores, -1.0)  # scores are >= 0: padding is never chosen
    k = tl.arange(0, K_BLOCK)
    weights = tl.zeros([K_BLOCK], dtype=tl.float32)
    ids = tl.zeros([K_BLOCK], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, 0)
        idx = tl.argmax(scores, 0)
        weights = tl.where(k == j, best, weights)
        ids = tl.where(k == j, idx, ids)
        scores = tl.where(e == idx, -2.0, scores)
    if RENORMALISE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    weights = weights * scale
    if EXTRA > 0:
        weights = tl.where(k >= TOP_K, 1.0, weights)
        ids = tl.where(k >= TOP_K, num_experts + (k - TOP_K), ids)
    k_mask = k < TOP_K + EXTRA
    tl.store(weights_ptr + row * (TOP_K + EXTRA) + k, weights, mask=k_mask)
    tl.store(ids_ptr + row * (TOP_K + EXTRA) + k, ids, mask=k_mask)


def moe_topk(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    scoring: str = "softmax",
    renormalise: bool = False,
    scale: float = 1.0,
    extra: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] (any float dtype) -> (weights [tokens, top_k + extra]
    fp32, ids [tokens, top_k + extra] int32), best first; the `extra` last slots are experts
    experts, experts + 1, ... with weight 1 (shared experts stored after the routed ones,
    models/moe.py), neither renormalised nor scaled."""
    op = "moe_topk"
    check_tensor(
        op,
        "router_logits",
        router_logits,
        shape=(None, None),
        dims="[tokens, experts]",
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
    )
    check_device(op, router_logits)
    tokens, experts = router_logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"{op}: top_k must be 1 to experts ({experts}), got {top_k}")
    if scoring not in _SCORINGS:
        raise ValueError(f"{op}: scoring must be one of {', '.join(_SCORINGS)}, got {scoring!r}")
    if extra < 0:
        raise ValueError(f"{op}: extra must be >= 0, got {extra}")
    device = router_logits.device
    weights = torch.empty((tokens, top_k + extra), dtype=torch.float32, device=device)
    ids = torch.empty((tokens, top_k + extra), dtype=torch.int32, device=device)
    if tokens:
        _moe_topk_kernel[(tokens,)](
            router_logits,
            weights,
            ids,
            experts,
            router_logits.stride(0),
            scale,
            TOP_K=top_k,
            EXTRA=extra,
            K_BLOCK=next_pow2(top_k + extra),
            E_BLOCK=next_pow2(experts),
            SIGMOID=scoring == "sigmoid",
            RENORMALISE=renormalise,
            num_warps=4 if experts > 256 else 1,
            **pdl_launch(router_logits.device),
        )
    return weights, ids
