"""Llama (and Mistral, and the base of Qwen2/Qwen3): pre-norm decoder, GQA, RoPE, SiLU MLP.

Tokens of all requests are flattened: activations are [num_tokens, hidden], never padded.
q/k/v and gate/up are each one matmul (`qkv_proj`, `gate_up_proj`); `STACKED` tells the
loader which checkpoint tensors fill which rows of them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from services.executor.attention import AttentionBackend
from services.executor.forward_batch import ForwardBatch
from services.executor.model_config import ModelConfig
from services.executor.models.layers import RMSNorm, Rope, RotaryEmbedding, SiluAndMulMLP
from services.executor.models.linear import Linear

# checkpoint module name -> (our fused module, shard index in it)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def shard_rows(config: ModelConfig, fused: str) -> list[int]:
    """Row counts of each shard of a fused projection, in order."""
    if fused == "qkv_proj":
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [q, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sizes = shard_rows(config, "qkv_proj")
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, sum(self.sizes), bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE; Llama has no q/k norm."""
        return q, k

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = rope.apply(*self.norm_qk(q, k))
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
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the add happens
        inside the next norm, fused."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


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
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final normed hidden state of each request's last new token: [bs, hidden]."""
        rope = self.rotary.prepare(batch.positions)
        x = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, batch)
        assert residual is not None
        # Only last tokens feed the LM head; the norm is per token, so select first.
        last = batch.last_token_indices()
        if batch.extra_indices is not None:
            last = torch.cat([last, batch.extra_indices])
        out, _ = self.norm(x[last], residual[last])
        return out


class LlamaForCausalLM(nn.Module):
    """Takes `(config, backend)`; `forward(batch)` -> last-token logits [bs, vocab] fp32."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend, self.attention_cls)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embed_tokens' weight with lm_head if the config says so; call again after
        anything that replaces parameters (`to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.init_forward_metadata(batch)
        h = self.model(batch)
        if batch.extra_indices is not None:
            batch.extra_hidden = h[batch.batch_size :]
            h = h[: batch.batch_size]
        return self.lm_head(h).float()
