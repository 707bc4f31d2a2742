"""Llama (and Mistral, and the base of Qwen2/Qwen3): pre-norm decoder, GQA, RoPE, SiLU MLP.

Tokens of all requests are flattened: activations are [num_tokens, hidden], never padded.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from services.executor.attention import AttentionBackend
from services.executor.forward_batch import ForwardBatch
from services.executor.model_config import ModelConfig
from services.executor.models.layers import RMSNorm, RotaryEmbedding, SiluAndMulMLP, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE; Llama has no q/k norm."""
        return q, k

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_cls(config, layer_id, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SiluAndMulMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, attention_cls: type[LlamaAttention]
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, attention_cls) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final normed hidden state of each request's last new token: [bs, hidden]."""
        cos, sin = self.rotary(batch.positions)
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        # Only last tokens feed the LM head; the norm is per token, so select first.
        return self.norm(x[batch.last_token_indices()])


class LlamaForCausalLM(nn.Module):
    """Takes `(config, backend)`; `forward(batch)` -> last-token logits [bs, vocab] fp32."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend, self.attention_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embed_tokens' weight with lm_head if the config says so; call again after
        anything that replaces parameters (`to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.init_forward_metadata(batch)
        return self.lm_head(self.model(batch)).float()
