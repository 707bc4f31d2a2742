"""The sparse mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek V2/V3).

    x ─▶ gate (router) ─▶ select_experts ─▶ experts (fused_moe on CUDA) ─┐
    └──▶ shared expert(s), Qwen2-MoE's scaled by sigmoid(shared_expert_gate(x)) ─┴▶ + ─▶ all-reduce

Routed experts are held stacked, [experts, ...], and filled from the checkpoint's per-expert
tensors (`experts.N.gate_proj.weight`...: `FusedExperts.checkpoint_parts`). Under tensor
parallelism every rank holds every expert's slice of the intermediate dimension, as the dense
MLP is split, and the routed and shared partial sums go through one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.shard import Shard
from services.executor.model_config import ModelConfig
from services.executor.models.layers import SiluAndMulMLP, on_gpu
from services.executor.models.linear import FP32_PRODUCTS, Linear
from services.executor.models.moe_routing import select_experts
from services.executor.moe_config import MoEConfig

# (checkpoint name under the module, the view it fills, its rows [start, end) there, the
# part of the checkpoint tensor this rank reads, and what writes it (None: copied as read)):
# what the weight loader needs.
CheckpointPart = tuple[str, torch.Tensor, int, int, Shard, Callable[..., None] | None]


class Router(Linear):
    """`gate` in checkpoints: [experts, hidden] logits weight, plus DeepSeek-V3's
    e_score_correction_bias [experts] when the config has one. Never quantized: routing
    decisions are sensitive, and its few bytes do not matter."""

    quantizable = False

    def __init__(self, hidden_size: int, moe: MoEConfig, logits_fp32: bool = False) -> None:
        super().__init__(hidden_size, moe.num_experts, bias=False)
        if logits_fp32:
            self.method = FP32_PRODUCTS
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts)) if moe.correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] -> logits [tokens, experts] (fp32 on the CPU, and always
        with logits_fp32)."""
        logits: torch.Tensor = super().forward(x)
        return logits if logits.is_cuda else logits.float()  # the CUDA routing kernel widens


class FusedExperts(nn.Module):
    """Every routed expert's SiLU-gated MLP, this rank's slice of each: w13_weight
    [experts, 2 * I_local, hidden] (gate rows, then up rows), w2_weight [experts, hidden,
    I_local]. forward gives this rank's partial sum (before the all-reduce).

    fp8 checkpoints (`use_fp8`: 128x128 block scales as DeepSeek's and Qwen's FP8 releases,
    or a scale per row as compressed-tensors' and --quantization fp8) keep the experts in
    e4m3 with fp32 w13_weight_scale and w2_weight_scale (models/fp8_experts.py); the grouped
    expert launches widen and scale them."""

    w13_weight_scale: torch.Tensor  # fp8 only
    w2_weight_scale: torch.Tensor
    fp8_scheme: str | None = None  # "block" or "channel" for fp8 experts
    scale_name = ""  # fp8: the checkpoint's name for the scales
    fp8_online = False  # fp8: quantized per row as the float weights load

    def __init__(self, moe: MoEConfig, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = moe.num_experts, hidden_size
        self.full_inter = moe.intermediate_size
        self.inter = tp.shard(moe.intermediate_size, "MoE intermediate size")
        self.tp = tp
        self.w13_weight = nn.Parameter(torch.empty(moe.num_experts, 2 * self.inter, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, self.inter))

    def use_fp8(self, scheme: str, scale_name: str, online: bool = False) -> None:
        """Hold the experts in fp8 with `scheme`'s scales ("block" or "channel",
        models/fp8_experts.py), read from the checkpoint's `scale_name` tensors, or with
        `online` computed per row as the float weights load (--quantization fp8)."""
        from services.executor.models import fp8_experts

        fp8_experts.make_fp8(self, scheme)
        self.fp8_scheme, self.scale_name, self.fp8_online = scheme, scale_name, online

    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13's, w2's) scales of fp8 experts, else None."""
        if self.fp8_scheme is None:
            return None
        if self.fp8_scheme == "channel":  # [experts, rows, 1] as checkpoints hold them
            return self.w13_weight_scale[..., 0], self.w2_weight_scale[..., 0]
        return self.w13_weight_scale, self.w2_weight_scale

    def init_dummy(self, gen: torch.Generator) -> set[int]:
        """fp8 experts: N(0, 0.02) weights quantized in their scheme (the ids of the
        parameters filled); 16-bit ones are left to the caller's N(0, 0.02)."""
        if self.fp8_scheme is None:
            return set()
        from services.executor.models import fp8_experts

        return fp8_experts.init_dummy(self, gen)

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        reduce: bool = True,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[tokens, hidden], plus `add` when given (rounded as `out + add`); on CUDA with
        reduce=False, the kernel's unsummed [tokens, top_k, hidden] (kernels/fused_moe.py)."""
        s13, s2 = self.scales() or (None, None)
        if on_gpu(x):
            from kernels.fused_moe import fused_moe

            w13, w2 = self.w13_weight, self.w2_weight
            return fused_moe(
                x.contiguous(), w13, w2, topk_weights, topk_ids, reduce=reduce, add=add,
                w13_scale=s13, w2_scale=s2,
            )  # fmt: skip
        from kernels.fused_moe import fused_moe_ref

        w13, w2 = self.w13_weight, self.w2_weight
        out = fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2)
        return out if add is None else out + add

    def checkpoint_parts(self, kind: str) -> Iterator[CheckpointPart]:
        """The per-expert checkpoint tensors that fill parameter `kind`, HF's names."""
        from services.executor.models import fp8_experts

        if kind.endswith("_scale"):
            yield from fp8_experts.scale_parts(self, kind, self.scale_name)
            return
        i, full, r = self.inter, self.full_inter, self.tp.rank
        cols = Shard(1, r * i, (r + 1) * i, full)
        rows = Shard(0, r * i, (r + 1) * i, full)
        for e in range(self.num_experts):
            f = None if self.fp8_scheme is None else fp8_experts.weight_fill(self, e, kind)
            if kind == "w13_weight":
                w = self.w13_weight[e]
                yield f"{e}.gate_proj.weight", w, 0, i, rows, f
                yield f"{e}.up_proj.weight", w, i, 2 * i, rows, f
            else:
                w = self.w2_weight[e]
                yield f"{e}.down_proj.weight", w, 0, self.hidden_size, cols, f


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: forward(x [tokens, hidden]) -> [tokens, hidden], summed over
    the ranks. Parameters under HF's names: gate, experts.N.*, shared_expert (+
    shared_expert_gate) for Qwen2-MoE, shared_experts for DeepSeek.

    `SparseMoE(config, layer_id, tp)` needs `config.moe`; `moe=` overrides it (a model whose
    config holds the MoE elsewhere).

    `defer_sum`, set by a decoder layer whose next step is a residual RMSNorm (which sums a
    token's rows itself, kernels/rmsnorm.py): the output may then be the experts' unsummed
    [tokens, top_k, hidden] (on CUDA, one rank, no shared expert), a launch fewer a layer."""

    defer_sum = False
    shared_slots = 0  # shared experts stored as routed experts (fuse_shared_experts)

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp: TPGroup = SINGLE,
        *,
        moe: MoEConfig | None = None,
    ) -> None:
        super().__init__()
        moe = moe or config.moe
        if moe is None:
            raise ValueError(f"SparseMoE for layer {layer_id} of a config without MoE")
        self.moe, self.layer_id, self.tp = moe, layer_id, tp
        hidden = config.hidden_size
        self.gate = Router(hidden, moe, logits_fp32=moe.router_fp32)
        self.experts = FusedExperts(moe, hidden, tp)
        # Qwen2-MoE's gated "shared_expert", DeepSeek's plain "shared_experts"
        self.shared_name = "shared_expert" if moe.shared_gate else "shared_experts"
        if moe.shared_intermediate_size:
            shared = SiluAndMulMLP(hidden, moe.shared_intermediate_size, False, tp)
            self.add_module(self.shared_name, shared)
        self.shared_expert_gate = Linear(hidden, 1) if moe.shared_gate else None
        if self.shared_expert_gate is not None:  # one row: never quantized (as vLLM's)
            self.shared_expert_gate.quantizable = False

    def after_loading(self) -> None:
        """On CUDA, ungated shared experts become routed ones (fuse_shared_experts)."""
        if on_gpu(self.experts.w13_weight):
            self.fuse_shared_experts()

    def fuse_shared_experts(self) -> None:
        """Store DeepSeek's shared experts (a SiLU-gated MLP of n times the routed experts'
        width, no gate) as n more experts after the routed ones, chosen by every token with
        weight 1 (select_experts' `extra`): the grouped expert launches then do their work,
        and the layer launches no shared GEMVs, activation or add. The sums are the same
        products; each shared slice's output is rounded once per slice (as a routed
        expert's), where the MLP rounded the whole shared output once. The shared module is
        removed (no memory is added). A no-op for gated shared experts (Qwen2-MoE), shared
        projections with a bias or another method than the plain weight (a quantized one),
        widths that are not a multiple, and a second call."""
        inter = self.experts.inter
        mlp = getattr(self, self.shared_name, None)
        if mlp is None or self.shared_expert_gate is not None or mlp.intermediate_size % inter:
            return
        width = mlp.intermediate_size  # this rank's
        slots = width // inter
        w13, w2 = self.experts.w13_weight, self.experts.w2_weight
        gate_up, down = mlp.gate_up_proj.weight, mlp.down_proj.weight  # [2W, H], [H, W]
        plain = mlp.gate_up_proj.plain and mlp.down_proj.plain
        if not plain or gate_up.dtype != w13.dtype or down.dtype != w2.dtype:
            return  # the experts' stacks hold plain weights only
        experts = w13.shape[0]
        new13 = w13.new_empty((experts + slots, *w13.shape[1:]))
        new2 = w2.new_empty((experts + slots, *w2.shape[1:]))
        new13[:experts].copy_(w13)
        new2[:experts].copy_(w2)
        for j in range(slots):
            cols = slice(j * inter, (j + 1) * inter)
            new13[experts + j, :inter].copy_(gate_up[:width][cols])
            new13[experts + j, inter:].copy_(gate_up[width:][cols])
            new2[experts + j].copy_(down[:, cols])
        self.experts.w13_weight = nn.Parameter(new13, requires_grad=False)
        self.experts.w2_weight = nn.Parameter(new2, requires_grad=False)
        delattr(self, self.shared_name)
        self.shared_slots = slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias
        weights, ids = select_experts(self.gate(x), self.moe, bias, extra=self.shared_slots)
        if self.moe.shared_intermediate_size and not self.shared_slots:
            shared = self._shared_partial(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            # added in the routed experts' own sum launch (one torch add fewer a layer)
            return self.tp.all_reduce(self.experts(x, weights, ids, add=shared))
        unsummed = self.defer_sum and self.tp.size == 1
        return self.tp.all_reduce(self.experts(x, weights, ids, reduce=not unsummed))

    def _shared_partial(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output on this rank before its all-reduce (done once, with
        the routed experts')."""
        mlp: SiluAndMulMLP = getattr(self, self.shared_name)
        gate_up = mlp.gate_up_proj(x)
        if on_gpu(gate_up):
            from kernels.gated_act import silu_mul

            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.split(mlp.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return Linear.forward(mlp.down_proj, act)  # the plain product: no all-reduce


def build_mlp(config: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> nn.Module:
    """The MLP of decoder layer `layer_id`: SparseMoE where the config makes it sparse, else
    the dense SiLU-gated MLP of `config.intermediate_size`."""
    if config.moe is not None and config.moe.is_sparse(layer_id):
        return SparseMoE(config, layer_id, tp)
    return SiluAndMulMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)
