"""Gemma 2 and Gemma 3 (text): Llama's attention and sharding with Gemma's arithmetic.

What differs from Llama, all read from ModelConfig:
- RMSNorm scales by (1 + w), in fp32 before the cast back; four norms per layer (before and
  after attention, before and after the MLP); the embedding is multiplied by sqrt(hidden)
  rounded to the model's dtype, as transformers does;
- the MLP is gated by GELU (tanh approximation);
- scores are scaled by query_pre_attn_scalar ** -0.5 and (Gemma 2) soft-capped in the
  attention kernels; the final logits are soft-capped (cap * tanh(x / cap));
- sliding-window layers interleaved with global ones: the backend masks keys out of a layer's
  window (the KV pool keeps every token, so the radix cache stays exact);
- Gemma 3 normalises q and k per head and has two RoPE bases: `rope_local_theta` for sliding
  layers, `rope_theta` with its scaling for global ones.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.attention import AttentionBackend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.layers import ParallelLMHead, VocabParallelEmbedding
from services.executor.forward_batch import ForwardBatch
from services.executor.model_config import ModelConfig
from services.executor.models.layers import Rope, RotaryEmbedding, SiluAndMulMLP, on_gpu
from services.executor.models.llama import HeadShards, LlamaAttention, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """rmsnorm(x) * (1 + w), in fp32, then cast to x's dtype; with `residual`, the add is
    fused as in layers.RMSNorm: returns (norm(x + residual), x + residual). The checkpoint's
    weight is w (zero-centred), as HF stores it."""

    unit_offset = True  # for the fused q/k norm of kernels/rotary

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if on_gpu(x) and x.dim() == 2:
            from kernels.rmsnorm import rmsnorm

            out, new_residual = rmsnorm(
                x, self.weight, self.eps, residual=residual, unit_offset=True
            )
            return out if residual is None else (out, new_residual)
        return self.torch_forward(x, residual)

    def torch_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The CPU path, q/k norms' [n, heads, head_dim] included (on CUDA those are fused
        into the rotary kernel: layers.Rope.apply)."""
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self(x, residual)
        assert isinstance(out, tuple)
        return out


class GeluAndMulMLP(SiluAndMulMLP):
    """SiluAndMulMLP's fused, sharded gate/up and down projections, gated by GELU-tanh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if on_gpu(gate_up):
            from kernels.gated_act import gelu_tanh_mul

            return self.down_proj(gelu_tanh_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(LlamaAttention):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(config, layer_id, backend, tp)
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcap
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.qk_norms = (self.q_norm, self.k_norm)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, layer_id, backend, tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GeluAndMulMLP(hidden, config.intermediate_size, config.mlp_bias, tp)
        # Gemma 3's sliding layers take the local RoPE; everything else the global one.
        self.local_rope = self.self_attn.window is not None and config.rope_local_theta is not None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: tuple[Rope, Rope | None],
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added), as Llama's."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        rope = ropes[1] if self.local_rope and ropes[1] is not None else ropes[0]
        h = self.self_attn(h, rope, batch)
        h = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm.add(h, residual)
        h = self.post_feedforward_layernorm(self.mlp(h))
        assert isinstance(h, torch.Tensor)
        return h, residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, backend, tp) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        context = config.max_position_embeddings
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, context
        )
        self.local_rotary: RotaryEmbedding | None = None
        if config.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(
                config.head_dim, config.rope_local_theta, None, context
            )
        self._embed_scales: dict[torch.dtype, float] = {}

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) rounded to `dtype` (HF multiplies by it as a tensor of the model's
        dtype); a Python float, so the multiply needs no tensor on the device."""
        if dtype not in self._embed_scales:
            self._embed_scales[dtype] = float(torch.tensor(self.hidden_size**0.5, dtype=dtype))
        return self._embed_scales[dtype]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final normed hidden state of each request's last new token: [bs, hidden]."""
        ropes = (
            self.rotary.prepare(batch.positions),
            self.local_rotary.prepare(batch.positions) if self.local_rotary else None,
        )
        x = self.embed_tokens(batch.input_ids)
        x = x * self.embed_scale(x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, ropes, batch)
        assert residual is not None
        rows = batch.output_rows()
        if rows is not None:
            x, residual = x[rows], residual[rows]
        out, _ = self.norm.add(x, residual)
        return out


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Takes `(config, backend, tp)`; `forward(batch)` -> last-token logits [bs, vocab] fp32,
    soft-capped when the config says so."""

    norm_offset: ClassVar[float] = 1.0  # norms scale by 1 + weight (weights/loader.py)

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        nn.Module.__init__(self)  # Llama's __init__ would build a LlamaModel
        self.config = config
        self.backend = backend
        self.tp = tp
        heads = HeadShards(config, tp)
        self.num_heads, self.num_kv_heads = heads.q, heads.kv  # this rank's
        self.model = GemmaModel(config, backend, tp)  # type: ignore[assignment]
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        logits = super().forward(batch)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2 plus q/k norms and a local RoPE base (both from the config)."""
