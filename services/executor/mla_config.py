"""DeepSeek's multi-head latent attention (MLA): the shape fields a config.json or GGUF file
adds to a ModelConfig (`ModelConfig.mla`), kept apart so other families never see them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.executor.errors import ModelLoadError


@dataclass(frozen=True)
class MLAConfig:
    """Per head, a query/key is `qk_nope_head_dim` position-free dims followed by
    `qk_rope_head_dim` rotated ones; a value is `v_head_dim` wide. Keys and values are both
    expanded from one shared latent of `kv_lora_rank` per token, which is what the KV pool
    caches (with the rotated key part beside it: `cache_dim` per token per layer)."""

    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are (x0, x1), (x2, x3)... (V2 always; V3's flag)
    softmax_scale: float  # 1/sqrt(qk head dim), times YaRN's mscale(all dims) squared
    rope_mscale: float  # YaRN's attention factor on the rotated dims' cos/sin (usually 1)
    first_k_dense_replace: int  # layers [0, k) are dense; later ones MoE if experts exist
    moe_layer_freq: int
    n_routed_experts: int | None  # None or 0: every layer dense

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements per token per layer in the latent KV pool: latent then rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            bool(self.n_routed_experts)
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> MLAConfig:
        """From a DeepSeek-V2/V3 config.json and its scaling as `_hf_rope` reads it."""
        missing = [
            k
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if not cfg.get(k)
        ]
        if missing:
            raise ModelLoadError(f"DeepSeek config.json lacks {', '.join(missing)}")
        return cls.build(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            rope_scaling=rope_scaling,
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
            n_routed_experts=cfg.get("n_routed_experts"),
        )

    @classmethod
    def build(cls, *, rope_scaling: dict[str, Any] | None, **fields: Any) -> MLAConfig:
        """The derived scales from the YaRN parameters (DeepSeek's own formulas)."""
        qk_head_dim = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
        scale, rope_mscale = qk_head_dim**-0.5, 1.0
        if rope_scaling is not None and rope_scaling.get("rope_type") in YARN_TYPES:
            factor = float(rope_scaling["factor"])
            mscale = rope_scaling.get("mscale")
            mscale_all_dim = rope_scaling.get("mscale_all_dim")
            if mscale_all_dim:
                scale *= yarn_mscale(factor, mscale_all_dim) ** 2
            if rope_scaling.get("attention_factor") is not None:
                rope_mscale = float(rope_scaling["attention_factor"])
            elif mscale and mscale_all_dim:
                rope_mscale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                rope_mscale = yarn_mscale(factor)
        return cls(softmax_scale=scale, rope_mscale=rope_mscale, **fields)


YARN_TYPES = ("yarn", "deepseek_yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
