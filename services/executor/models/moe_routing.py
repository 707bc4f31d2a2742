"""Which experts each token goes to, and with what weight: pure torch, no host sync and fixed
output shapes, so it runs inside a captured CUDA graph.

`select_experts(logits, moe)` covers the routing of every family MoEConfig describes: plain
top-k over softmax (Qwen2/3-MoE, Mixtral) or sigmoid scores, DeepSeek-V2's group-limited
greedy and DeepSeek-V3's grouped top-k with score correction; renormalised or not, scaled.
"""

from __future__ import annotations

import torch

from services.executor.moe_config import MoEConfig


def select_experts(
    router_logits: torch.Tensor,
    moe: MoEConfig,
    correction_bias: torch.Tensor | None = None,
    extra: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] -> (weights [tokens, top_k] fp32, ids [tokens, top_k]
    int64; int32 from the CUDA kernel). correction_bias [experts]: DeepSeek-V3's
    e_score_correction_bias (noaux_tc only), added to the scores for choosing experts, never
    to their weights.

    On CUDA, greedy routing is one kernel (kernels/moe_topk.py); this torch code is its twin,
    and the path of the grouped methods. extra: slots appended to each token's choice,
    experts num_experts, num_experts + 1, ... with weight 1 (shared experts stored after the
    routed ones: SparseMoE.fuse_shared_experts)."""
    if router_logits.is_cuda and moe.topk_method == "greedy":
        from kernels.moe_topk import moe_topk

        return moe_topk(
            router_logits,
            top_k=moe.top_k,
            scoring=moe.scoring,
            renormalise=moe.norm_topk_prob,
            scale=moe.routed_scaling_factor,
            extra=extra,
        )
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    if moe.topk_method == "greedy":
        weights, ids = scores.topk(moe.top_k, dim=-1)
    elif moe.topk_method == "group_limited_greedy":
        groups = scores.view(-1, moe.n_group, moe.num_experts // moe.n_group).amax(dim=-1)
        masked = scores.masked_fill(~_group_mask(groups, moe), 0.0)
        weights, ids = masked.topk(moe.top_k, dim=-1)
    else:  # noaux_tc
        assert correction_bias is not None, "noaux_tc routing needs e_score_correction_bias"
        choice = scores + correction_bias.float()
        per_group = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
        groups = per_group.topk(2, dim=-1).values.sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(groups, moe), float("-inf"))
        ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    if extra:
        tokens = weights.shape[0]
        shared = torch.arange(moe.num_experts, moe.num_experts + extra, device=ids.device)
        ids = torch.cat([ids, shared.to(ids.dtype).expand(tokens, extra)], dim=1)
        weights = torch.cat([weights, weights.new_ones(tokens, extra)], dim=1)
    return weights, ids


def _group_mask(group_scores: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """group_scores [tokens, n_group] -> bool [tokens, experts]: experts of the topk_group
    best groups."""
    best = group_scores.topk(moe.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    per_group = moe.num_experts // moe.n_group
    return keep[:, :, None].expand(-1, -1, per_group).reshape(-1, moe.num_experts)
