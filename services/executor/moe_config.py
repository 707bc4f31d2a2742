"""The mixture-of-experts part of a model's shape: `ModelConfig.moe` (None for a dense model).

Kept apart from ModelConfig so that each family's MoE keys are read in one place, from a HF
config.json (`from_hf`) or from GGUF metadata (`from_gguf`). Routing options cover Qwen2-MoE,
Qwen3-MoE, Mixtral and DeepSeek V2/V3 (services/executor/models/moe_routing.py applies them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.executor.errors import ModelLoadError, UnsupportedModelError

SCORING_FUNCS = ("softmax", "sigmoid")
# "greedy": top-k over all experts; "group_limited_greedy": DeepSeek-V2's (groups ranked by
# their best expert); "noaux_tc": DeepSeek-V3's (groups ranked by their two best experts,
# choice scores shifted by e_score_correction_bias).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (all SiLU-gated MLPs of `intermediate_size`), their router, and the
    shared expert(s) beside them.

    Routing of one token: scores = scoring(router logits) in fp32; top_k experts chosen by
    `topk_method` (within the best `topk_group` of `n_group` groups for the grouped methods);
    weights = their scores, divided by their sum if `norm_topk_prob`, times
    `routed_scaling_factor`. The shared expert (intermediate `shared_intermediate_size`, 0 for
    none) sees every token; with `shared_gate` its output is scaled by sigmoid(x . w) (Qwen2-MoE).
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is this MoE
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # the router holds e_score_correction_bias [num_experts]
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    router_fp32: bool = False  # router logits from fp32 weights and inputs (DeepSeek's)

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise UnsupportedModelError(
                f"unsupported MoE scoring function {self.scoring!r}; supported: "
                f"{', '.join(SCORING_FUNCS)}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise UnsupportedModelError(
                f"unsupported MoE top-k method {self.topk_method!r}; supported: "
                f"{', '.join(TOPK_METHODS)}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"MoE top_k {self.top_k} must be between 1 and num_experts {self.num_experts}"
            )
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ModelLoadError(
                f"MoE groups: {self.num_experts} experts in n_group {self.n_group}, topk_group "
                f"{self.topk_group}: n_group must divide the experts and topk_group <= n_group"
            )
        if self.topk_method == "noaux_tc" and self.num_experts // self.n_group < 2:
            raise ModelLoadError("noaux_tc routing ranks groups by 2 experts: groups need >= 2")

    def is_sparse(self, layer_id: int) -> bool:
        """True when decoder layer `layer_id`'s MLP is this MoE (else a dense MLP)."""
        return layer_id in self.sparse_layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        """From a config.json's keys (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek V2/V3); None
        for a dense model."""
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        num_experts = num_experts or cfg.get("n_routed_experts")
        if not num_experts:
            return None
        model_type = cfg.get("model_type", "")
        num_layers = int(cfg["num_hidden_layers"])
        dense = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step") or 1)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        if "first_k_dense_replace" in cfg:  # DeepSeek: layer >= k and layer % freq == 0
            sparse = [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
        else:  # Qwen: (layer + 1) % decoder_sparse_step == 0, minus mlp_only_layers
            sparse = [i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense]
        if not sparse:  # experts declared, none used (DeepSeek with every layer dense)
            return None
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        n_shared = int(cfg.get("n_shared_experts") or 0)
        moe_inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        # transformers' DeepseekV3Config drops these two keys (its router hard-codes them).
        v3 = model_type == "deepseek_v3"
        topk_method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        return cls(
            num_experts=int(num_experts),
            top_k=int(cfg.get("num_experts_per_tok") or 2),
            intermediate_size=moe_inter,
            sparse_layers=tuple(sparse),
            scoring=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            # Mixtral always renormalises and has no key for it.
            norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "mixtral")),
            topk_method=topk_method,
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            correction_bias=topk_method == "noaux_tc",
            shared_intermediate_size=shared or n_shared * moe_inter,
            shared_gate=bool(shared),
            router_fp32="n_routed_experts" in cfg,  # DeepSeek V2/V3
        )

    @classmethod
    def from_gguf(
        cls, get: Callable[[str, Any], Any], arch: str, tensors: dict[str, Any], num_layers: int
    ) -> MoEConfig | None:
        """From llama.cpp's metadata (`{arch}.expert_count`, ...) and tensor names; None for a
        dense model. `get(key, default)` reads one metadata key.

        The router is read as llama.cpp runs it: `expert_gating_func` (unset: softmax, as
        llama.cpp assumes for early deepseek2 files), `expert_weights_norm`,
        `expert_weights_scale` (0 or unset: 1), `expert_group_count` / `_used_count`. A
        correction bias (`exp_probs_b`) is DeepSeek-V3's noaux_tc; groups without one are
        DeepSeek-V2's group-limited greedy."""
        num_experts = int(get(f"{arch}.expert_count", 0) or 0)
        if not num_experts:
            return None
        sparse = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
        if arch == "deepseek2":
            _check_leading_dense(get, arch, sparse, num_layers)
        if not sparse:  # experts declared, none used (every layer dense)
            return None
        first = sparse[0]
        gate_exps = tensors.get(f"blk.{first}.ffn_gate_exps.weight")
        if gate_exps is None:
            raise ModelLoadError(f"GGUF {arch} with {num_experts} experts has no ffn_gate_exps")
        # ggml shape [hidden, intermediate, experts]
        inter = int(get(f"{arch}.expert_feed_forward_length", 0) or gate_exps.shape[1])
        n_group = int(get(f"{arch}.expert_group_count", 0) or 1)
        bias = f"blk.{first}.exp_probs_b.bias" in tensors
        grouped = "group_limited_greedy" if n_group > 1 else "greedy"  # DeepSeek-V2's
        topk_method = "noaux_tc" if bias else grouped
        scale = float(get(f"{arch}.expert_weights_scale", 0.0) or 1.0)
        return cls(
            num_experts=num_experts,
            top_k=int(get(f"{arch}.expert_used_count", 2)),
            intermediate_size=inter,
            sparse_layers=sparse,
            scoring=_gguf_scoring(get, arch),
            norm_topk_prob=bool(get(f"{arch}.expert_weights_norm", arch not in _NO_NORM)),
            topk_method=topk_method,
            n_group=n_group,
            topk_group=int(get(f"{arch}.expert_group_used_count", 0) or n_group),
            routed_scaling_factor=scale,
            correction_bias=bias,
            shared_intermediate_size=_gguf_shared_size(get, arch, tensors, first, inter),
            shared_gate=f"blk.{first}.ffn_gate_inp_shexp.weight" in tensors,
            router_fp32=arch == "deepseek2",  # as for DeepSeek's HF checkpoints
        )


# llama.cpp renormalises the top-k weights for Mixtral ("llama") and Qwen3-MoE unless told;
# not for these unless `expert_weights_norm` says so.
_NO_NORM = ("qwen2moe", "deepseek2")
# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType); 0 or unset: softmax.
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _gguf_scoring(get: Callable[[str, Any], Any], arch: str) -> str:
    gating = int(get(f"{arch}.expert_gating_func", 0) or 1)
    if gating not in _GGUF_GATING:
        raise UnsupportedModelError(
            f"GGUF {arch}: expert_gating_func {gating} is not supported; supported: "
            + ", ".join(f"{value} ({name})" for value, name in _GGUF_GATING.items())
        )
    return _GGUF_GATING[gating]


def _gguf_shared_size(
    get: Callable[[str, Any], Any], arch: str, tensors: dict[str, Any], layer: int, inter: int
) -> int:
    """The shared expert's intermediate size: Qwen2-MoE's `expert_shared_feed_forward_length`,
    DeepSeek's `expert_shared_count` experts of `inter` side by side, else the tensor's."""
    shared = int(get(f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    shared = shared or int(get(f"{arch}.expert_shared_count", 0) or 0) * inter
    shexp = tensors.get(f"blk.{layer}.ffn_gate_shexp.weight")
    if shexp is None:
        if shared:
            raise ModelLoadError(
                f"GGUF {arch} declares shared experts ({shared} wide) but layer {layer} has "
                "no ffn_gate_shexp"
            )
        return 0
    if shared and shared != int(shexp.shape[1]):  # ggml shape [hidden, intermediate]
        raise ModelLoadError(
            f"GGUF {arch}: shared experts {shared} wide by the metadata, "
            f"{int(shexp.shape[1])} by ffn_gate_shexp of layer {layer}"
        )
    return int(shexp.shape[1])


def _check_leading_dense(
    get: Callable[[str, Any], Any], arch: str, sparse: tuple[int, ...], num_layers: int
) -> None:
    """deepseek2 has no moe_layer_freq: its layers from `leading_dense_block_count` on are
    sparse, all of them (what MLAConfig.is_moe_layer is then told)."""
    lead = int(get(f"{arch}.leading_dense_block_count", sparse[0] if sparse else num_layers))
    if sparse and sparse != tuple(range(lead, num_layers)):
        raise UnsupportedModelError(
            f"GGUF {arch}: routed experts (ffn_gate_inp) in layers {list(sparse)}, but "
            f"leading_dense_block_count {lead} of {num_layers} layers means every layer from "
            f"{lead} on; dense layers among sparse ones (moe_layer_freq > 1) are not read "
            "from GGUF"
        )
