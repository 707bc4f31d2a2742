"""Routed experts in fp8 (models/moe.py's FusedExperts): the parameters, the checkpoint
tensors that fill them, and dummy weights, for the two scale layouts the grouped expert
launches read (kernels/fused_moe.py):

- "block": DeepSeek's and Qwen's FP8 releases, one fp32 scale per 128x128 block, named
  `weight_scale_inv` (compressed-tensors' block strategy: `weight_scale`): w13_weight_scale
  [experts, 2 * ceil(I / 128), ceil(hidden / 128)], gate's block rows then up's (the
  checkpoint holds them as two tensors), and w2_weight_scale [experts, ceil(hidden / 128),
  ceil(I / 128)];
- "channel": compressed-tensors' per-channel fp8 (`weight_scale` [rows, 1]) and
  `--quantization fp8`, which quantizes each expert row as it loads: w13_weight_scale
  [experts, 2 * I, 1] and w2_weight_scale [experts, hidden, 1], the checkpoint's shape
  (FusedExperts.scales gives them as [experts, rows]).

Weights are e4m3, [experts, 2 * I, hidden] and [experts, hidden, I], this rank's slice of I.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.executor.distributed.shard import WHOLE, Shard
from services.executor.errors import UnsupportedQuantizationError

if TYPE_CHECKING:
    from services.executor.models.moe import CheckpointPart, FusedExperts

BLOCK = 128  # the rows and columns of a block scale
SCHEMES = ("block", "channel")


def make_fp8(experts: FusedExperts, scheme: str) -> None:
    """Give `experts` (on the meta device, before storage is allocated) fp8 weights and the
    scales of `scheme`. Under tensor parallelism with block scales each rank's slice of the
    intermediate dimension must be whole blocks."""
    assert scheme in SCHEMES, scheme
    if scheme == "block" and experts.tp.size > 1 and experts.inter % BLOCK:
        raise UnsupportedQuantizationError(
            f"fp8 experts: each rank's {experts.inter} of the {experts.full_inter} intermediate "
            f"rows must be whole {BLOCK}-row scale blocks at tp {experts.tp.size}"
        )
    e, i, h = experts.num_experts, experts.inter, experts.hidden_size
    device = experts.w13_weight.device

    def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

    experts.w13_weight = param(e, 2 * i, h, dtype=torch.float8_e4m3fn)
    experts.w2_weight = param(e, h, i, dtype=torch.float8_e4m3fn)
    if scheme == "block":
        ib, hb = -(-i // BLOCK), -(-h // BLOCK)
        experts.w13_weight_scale = param(e, 2 * ib, hb, dtype=torch.float32)
        experts.w2_weight_scale = param(e, hb, ib, dtype=torch.float32)
    else:
        experts.w13_weight_scale = param(e, 2 * i, 1, dtype=torch.float32)
        experts.w2_weight_scale = param(e, h, 1, dtype=torch.float32)


def weight_fill(experts: FusedExperts, e: int, kind: str) -> partial[None]:
    """What writes expert e's checkpoint rows into `kind` (w13_weight or w2_weight): the e4m3
    rows as they are (any other dtype refused: a cast would drop the scales), or with
    `online` the float rows quantized per row, their scales beside them."""
    from services.executor.quant.fp8_linear import copy_fp8, quantize_rows_into

    w = getattr(experts, kind)[e]
    if experts.fp8_online:
        return partial(quantize_rows_into, w, getattr(experts, f"{kind}_scale")[e])
    return partial(copy_fp8, w)


def scale_parts(experts: FusedExperts, kind: str, name: str) -> Iterator[CheckpointPart]:
    """The checkpoint's scale tensors (`name`) that fill `kind` (w13_weight_scale or
    w2_weight_scale); none when they are computed at load (`online`)."""
    if experts.fp8_online:
        return
    i, full, r, h = experts.inter, experts.full_inter, experts.tp.rank, experts.hidden_size
    w13 = kind == "w13_weight_scale"
    if experts.fp8_scheme == "block":
        ib, full_ib = -(-i // BLOCK), -(-full // BLOCK)
        span = (ib, Shard(0, r * ib, (r + 1) * ib, full_ib))
        down = (-(-h // BLOCK), Shard(1, r * ib, (r + 1) * ib, full_ib))
    else:  # a row's scale: its rows shard as the weight's; down's rows are whole
        span = (i, Shard(0, r * i, (r + 1) * i, full))
        down = (h, WHOLE)
    for e in range(experts.num_experts):
        s = getattr(experts, kind)[e]
        if w13:
            n, shard = span
            yield f"{e}.gate_proj.{name}", s, 0, n, shard, None
            yield f"{e}.up_proj.{name}", s, n, 2 * n, shard, None
        else:
            n, shard = down
            yield f"{e}.down_proj.{name}", s, 0, n, shard, None


def init_dummy(experts: FusedExperts, gen: torch.Generator) -> set[int]:
    """N(0, 0.02) weights quantized in the experts' scheme, an expert at a time (as
    kernels/fused_moe.quantize_experts lays them out); the ids of the parameters filled."""
    from kernels.fused_moe import quantize_experts

    w13, w2 = experts.w13_weight, experts.w2_weight
    s13, s2 = experts.w13_weight_scale, experts.w2_weight_scale
    for e in range(experts.num_experts):
        d13, d2 = (torch.empty(1, *w.shape[1:], device=w.device) for w in (w13, w2))
        d13.normal_(0.0, 0.02, generator=gen)
        d2.normal_(0.0, 0.02, generator=gen)
        q13, q2, scale13, scale2 = quantize_experts(d13, d2, rows=experts.fp8_scheme == "channel")
        w13[e].copy_(q13[0])
        w2[e].copy_(q2[0])
        s13[e].copy_(scale13[0].view_as(s13[e]))  # per row: the parameters' [rows, 1]
        s2[e].copy_(scale2[0].view_as(s2[e]))
    return {id(p) for p in (w13, w2, s13, s2)}
