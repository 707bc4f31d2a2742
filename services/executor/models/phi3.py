"""Phi-3 (mini, medium, Phi-3.5-mini, Phi-4-mini): Llama's layers with q/k/v and gate/up
fused in the checkpoint itself, LongRoPE scaling and, on Phi-4-mini, RoPE over only part of
each head (ModelConfig.rotary_dim; kernels/rope_freq.py picks LongRoPE's factors).

The checkpoint's `qkv_proj` holds [q; k; v] rows and `gate_up_proj` [gate; up], the order our
fused projections use; the loader still splits them into q/k/v and gate/up parts
(`checkpoint_splits`), so that under tensor parallelism each rank reads its own heads and its
own gate and up rows, not the first rows of the stacked tensor.

Phi-3's sliding window is not applied: the served context is clamped to it (ModelConfig), so
attention is exact within it, as for Mistral.
"""

from __future__ import annotations

from services.executor.attention import AttentionBackend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.model_config import ModelConfig
from services.executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        if config.attention_bias or config.o_proj_bias or config.mlp_bias:
            raise ValueError("Phi-3 has no biases: the config must not ask for them")
        super().__init__(config, backend, tp)

    def checkpoint_splits(self) -> dict[str, list[tuple[str, int]]]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return {
            "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            "gate_up_proj": [("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)],
        }
