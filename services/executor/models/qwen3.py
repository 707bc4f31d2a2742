"""Qwen3: Llama plus a per-head RMSNorm on q and k before RoPE, no q/k/v biases."""

from __future__ import annotations

from services.executor.attention import AttentionBackend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.model_config import ModelConfig
from services.executor.models.layers import RMSNorm
from services.executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(config, layer_id, backend, tp)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        # RMSNorm over the last dim of [num_tokens, heads, head_dim] normalises each head
        self.qk_norms = (self.q_norm, self.k_norm)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
