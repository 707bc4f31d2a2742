"""Llama (and Mistral, and the base of Qwen2/Qwen3): pre-norm decoder, GQA, RoPE, SiLU MLP.

Tokens of all requests are flattened: activations are [num_tokens, hidden], never padded.
q/k/v and gate/up are each one matmul (`qkv_proj`, `gate_up_proj`); `STACKED` tells the
loader which checkpoint tensors fill which rows of them.

Under tensor parallelism (a `tp` group of several ranks) each rank holds its share of the
attention heads and of the MLP's intermediate size, and a slice of the vocabulary
(distributed/layers.py); with fewer KV heads than ranks each KV head is held by the
`tp.size // num_kv_heads` ranks whose query heads read it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from services.executor.attention import AttentionBackend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from services.executor.forward_batch import ForwardBatch
from services.executor.model_config import ModelConfig
from services.executor.models.layers import HeadNorm, RMSNorm, Rope, RotaryEmbedding
from services.executor.models.moe import SparseMoE, build_mlp
from services.executor.quant.base import QuantConfig

# checkpoint module name -> (our fused module, shard index in it)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class HeadShards:
    """The attention heads of one rank: query heads [q_start, q_start + q), KV heads
    [kv_start, kv_start + kv)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        self.q = tp.shard(config.num_heads, "attention heads")
        self.q_start = tp.rank * self.q
        kv = config.num_kv_heads
        if kv >= tp.size:
            self.kv = tp.shard(kv, "KV heads")
            self.kv_start = tp.rank * self.kv
        else:  # fewer KV heads than ranks: each is replicated on the ranks that read it
            if tp.size % kv:
                raise ValueError(
                    f"--tp-size {tp.size} must be a multiple of the model's {kv} KV heads "
                    "when it exceeds them"
                )
            self.kv, self.kv_start = 1, tp.rank * kv // tp.size


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        heads = HeadShards(config, tp)
        self.num_heads, self.num_kv_heads = heads.q, heads.kv  # this rank's
        self.head_dim = hd = config.head_dim
        self.sizes = [heads.q * hd, heads.kv * hd, heads.kv * hd]
        hidden = config.hidden_size
        q_full, kv_full = config.num_heads * hd, config.num_kv_heads * hd
        parts = [
            (q_full, heads.q_start * hd, heads.q * hd),
            (kv_full, heads.kv_start * hd, heads.kv * hd),
            (kv_full, heads.kv_start * hd, heads.kv * hd),
        ]
        self.qkv_proj = ColumnParallelLinear(hidden, parts, config.attention_bias, tp)
        self.o_proj = RowParallelLinear(q_full, hidden, config.o_proj_bias, tp)
        self.window = config.layer_window(layer_id)  # Mistral's, Phi-3's...; None: full
        # Gemma's: a query_pre_attn_scalar scale and a score cap (None: 1/sqrt(head_dim), none)
        self.scale: float | None = None
        self.softcap: float | None = None
        # Qwen3's and Gemma 3's per-head q and k norms before RoPE (None: Llama has none)
        self.qk_norms: tuple[HeadNorm, HeadNorm] | None = None

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        store = None
        if rope.cos_sin_cache is not None:  # the rotation's launch writes the pool as well
            buffers = self.backend.fused_kv_store(self.layer_id, batch, k.dtype)
            if buffers is not None:
                from kernels.rotary import KVStore

                store = KVStore(v, *buffers, batch.out_cache_loc)
        q, k = rope.apply(q, k, self.qk_norms, store)
        out = self.backend.forward(
            q, k, v, self.layer_id, batch,
            scale=self.scale, window=self.window, softcap=self.softcap,
            kv_stored=store is not None,
        )  # fmt: skip
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_cls(config, layer_id, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer_id, tp)  # dense, or SparseMoE (models/moe.py)
        if isinstance(self.mlp, SparseMoE):  # the next norm sums the experts' rows
            self.mlp.defer_sum = True

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
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, attention_cls, tp)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.rotary_dim,
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
        rows = batch.output_rows()
        if rows is not None:
            x, residual = x[rows], residual[rows]
        out, _ = self.norm(x, residual)
        return out


class LlamaForCausalLM(nn.Module):
    """Takes `(config, backend, tp)`; `forward(batch)` -> last-token logits [bs, vocab] fp32
    (the whole vocabulary on every rank)."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    # (checkpoint substring, ours): applied to every checkpoint name before loading
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # the projections' weight format, set by quant/apply.py; None: the model dtype
    quantization: QuantConfig | None = None

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.tp = tp
        heads = HeadShards(config, tp)
        self.num_heads, self.num_kv_heads = heads.q, heads.kv  # this rank's
        self.model = LlamaModel(config, backend, self.attention_cls, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()

    def checkpoint_splits(self) -> dict[str, list[tuple[str, int]]]:
        """Checkpoint modules that stack several of the ones `STACKED` names, along rows:
        fused name -> [(module, full rows)] in order (the loader splits them). Llama's
        checkpoints keep every projection apart."""
        return {}

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
