"""DeepSeek-V2 and V3: multi-head latent attention (MLA) over a Llama-style decoder.

Keys and values of every head are expanded from one latent per token (`kv_lora_rank` wide,
after kv_a_layernorm) plus a rotated key part shared by all heads (`qk_rope_head_dim`). The
KV pool caches exactly that (kv_pool.py's latent layout), and attention never expands it:
W_UK (the key half of kv_b_proj) is absorbed into each head's query and W_UV (the value
half) applied after attention, so every step is MQA over `kv_lora_rank + qk_rope_head_dim`
wide keys whose first `kv_lora_rank` elements are the values. Prefill takes the same absorbed
path as decode (one attention kernel pair, one cache layout; SGLang expands K/V for long
prefills instead, which costs less compute there: a later optimisation).

Rotary pairs are interleaved, (x0, x1), (x2, x3)...: we de-interleave the rotated part of q
and k (the same permutation for both, so q.k is unchanged) and apply the usual rotate-half
RoPE, which is what transformers' V3 does. YaRN's attention factor multiplies the rotated
parts; its mscale correction is in the softmax scale (mla_config.py).

Tensor parallelism shards the heads (q_proj / q_b_proj, kv_b_proj, o_proj); q_a_proj and
kv_a_proj_with_mqa are replicated, and so is the latent cache, on every rank.

Past the first `first_k_dense_replace` dense layers, every `moe_layer_freq`-th layer's MLP is
models/moe.py's SparseMoE: V2's softmax router (greedy or group-limited), V3's sigmoid router
with its correction bias and grouped top-k, and the shared experts.
"""

from __future__ import annotations

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
from services.executor.errors import ModelLoadError
from services.executor.forward_batch import ForwardBatch
from services.executor.mla_config import MLAConfig
from services.executor.model_config import ModelConfig
from services.executor.models.layers import RMSNorm, Rope, RotaryEmbedding, on_gpu
from services.executor.models.linear import UNQUANTIZED, Linear
from services.executor.models.llama import (
    HeadShards,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from services.executor.models.moe import SparseMoE, build_mlp


def mla_of(config: ModelConfig) -> MLAConfig:
    if config.mla is None:
        raise ValueError(f"{config.architecture}: the config has no latent attention fields")
    return config.mla


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with pairs (x0, x1), (x2, x3)... -> [x0, x2, ..., x1, x3, ...], contiguous."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()


class MLAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.mla = m = mla_of(config)
        self.layer_id, self.backend = layer_id, backend
        heads = HeadShards(config, tp)
        self.num_heads = h = heads.q  # this rank's
        hidden, bias = config.hidden_size, config.attention_bias
        full_h = config.num_heads
        self.q_lora_rank = m.q_lora_rank

        def per_head(width: int) -> list[tuple[int, int, int]]:
            return [(full_h * width, heads.q_start * width, h * width)]

        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, per_head(m.qk_head_dim), False, tp)
        else:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, per_head(m.qk_head_dim), False, tp)
        self.kv_a_proj_with_mqa = Linear(hidden, m.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, config.rms_norm_eps)
        # Never applied as a projection: its halves are absorbed (w_uk, w_uv).
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, per_head(m.qk_nope_head_dim + m.v_head_dim), False, tp
        )
        self.o_proj = RowParallelLinear(full_h * m.v_head_dim, hidden, bias, tp)
        # Set by after_loading: q_proj (or q_a_proj) and kv_a_proj_with_mqa as one product.
        self.input_proj: Linear | None = None
        self.input_split = 0

    def after_loading(self) -> None:
        """Concatenate the two projections of the layer's input (q_proj, or q_a_proj with a
        query LoRA, and kv_a_proj_with_mqa) into one weight, so that a decode step reads x
        and launches once where it launched twice (DeepSeek-V2-Lite: a [3072 + 576, 2048]
        product a layer). The two modules keep views of it (no memory is added); each output
        element is the same dot product as before. Left apart when either is quantized or
        has a bias. A quantized kv_b_proj is dequantized first (`_plain_kv_b`)."""
        self._plain_kv_b()
        first, second = self._input_projections()
        plain = first.plain and second.plain and first.weight.dtype == second.weight.dtype
        if not plain or self.input_proj is not None:
            return
        weight = torch.cat([first.weight, second.weight])
        split = first.weight.shape[0]
        with torch.device("meta"):
            fused = Linear(weight.shape[1], weight.shape[0], bias=False)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        first.weight = nn.Parameter(weight[:split], requires_grad=False)
        second.weight = nn.Parameter(weight[split:], requires_grad=False)
        first.in_use = second.in_use = False  # _project_input calls input_proj instead
        self.input_proj, self.input_split = fused, split

    def _plain_kv_b(self) -> None:
        """kv_b_proj is never applied as a projection: its halves are read as matrices
        (`absorbed`), so a quantized checkpoint's (DeepSeek's FP8 release holds it in e4m3
        with 128x128 block scales) is dequantized once, after loading, to the model's dtype,
        and its format's tensors are dropped: [heads x 256, 512] a layer at V3's shapes, 32 MiB
        in bf16 against 16 in fp8."""
        kv_b = self.kv_b_proj
        if kv_b.method is UNQUANTIZED:
            return
        weight = kv_b.method.dequantized(kv_b).to(self.kv_a_layernorm.weight.dtype)
        for name, _ in list(kv_b.named_parameters(recurse=False)):
            if name not in ("weight", "bias"):
                delattr(kv_b, name)
        kv_b.weight = nn.Parameter(weight, requires_grad=False)
        kv_b.method = UNQUANTIZED

    def _input_projections(self) -> tuple[Linear, Linear]:
        """The two projections of the layer's input: q_proj (q_a_proj with a query LoRA)
        and kv_a_proj_with_mqa."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return first, self.kv_a_proj_with_mqa

    def _project_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x)): row-strided views of one
        product once after_loading has fused them."""
        if self.input_proj is None:
            first, second = self._input_projections()
            return first(x), second(x)
        both = self.input_proj(x)
        return both[:, : self.input_split], both[:, self.input_split :]

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV^T [heads, rank, v]): views of kv_b_proj's weight."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, -1, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :].transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch) -> torch.Tensor:
        m, n, h = self.mla, x.shape[0], self.num_heads
        q, kv = self._project_input(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(n, h, m.qk_head_dim)
        if self._fused(kv, rope, batch):
            return self._forward_fused(q, kv, rope, batch)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.reshape(n, 1, m.qk_rope_head_dim)
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        else:
            q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        q_pe, k_pe = rope.apply(q_pe, k_pe)
        if m.rope_mscale != 1.0:
            q_pe, k_pe = q_pe * m.rope_mscale, k_pe * m.rope_mscale
        w_uk, w_uv = self.absorbed()
        # [heads, n, nope] @ [heads, nope, rank]: each head's query in latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_pe], dim=-1)  # [n, heads, cache_dim]
        cache_row = torch.cat([latent, k_pe.view(n, -1)], dim=-1).view(n, 1, m.cache_dim)
        out = self.backend.forward_mla(
            query, cache_row, self.layer_id, batch, m.softmax_scale, m.kv_lora_rank
        )  # [n, heads, rank]
        out = torch.bmm(out.transpose(0, 1), w_uv)  # [heads, n, v]
        return self.o_proj(out.transpose(0, 1).reshape(n, h * m.v_head_dim))

    def _fused(self, kv: torch.Tensor, rope: Rope, batch: ForwardBatch) -> bool:
        """Whether the CUDA kernels take the step between the projections and attention:
        a pool in the model's dtype (an fp8 pool's rows are quantised by set_latent)."""
        pool = batch.kv_pool.k_buffers[self.layer_id]
        return on_gpu(kv) and rope.cos_sin_cache is not None and pool.dtype == kv.dtype

    def _forward_fused(
        self, q: torch.Tensor, kv: torch.Tensor, rope: Rope, batch: ForwardBatch
    ) -> torch.Tensor:
        """forward's path on CUDA: kernels/mla_prep writes the query's rotated part and the
        new cache rows (into the pool), the absorbed products write into their outputs
        (kernels/head_gemv for decode batches): no concatenation, no transposed copies."""
        from kernels.head_gemv import MAX_TOKENS, OUTPUT_TILES, QUERY_TILES, head_gemv
        from kernels.mla_prep import mla_prep

        m, n, h = self.mla, q.shape[0], self.num_heads
        assert rope.cos_sin_cache is not None
        query = torch.empty((n, h, m.cache_dim), dtype=q.dtype, device=q.device)
        mla_prep(
            q=q,
            kv=kv,
            query=query,
            buffer=batch.kv_pool.k_buffers[self.layer_id],
            out_cache_loc=batch.out_cache_loc,
            positions=rope.positions,
            cos_sin_cache=rope.cos_sin_cache,
            norm_weight=self.kv_a_layernorm.weight,
            eps=self.kv_a_layernorm.eps,
            rank=m.kv_lora_rank,
            interleave=m.rope_interleave,
            mscale=m.rope_mscale,
        )
        w_uk, w_uv = self.absorbed()
        q_nope, q_latent = q[..., : m.qk_nope_head_dim], query[..., : m.kv_lora_rank]
        small = n <= MAX_TOKENS
        if small:
            bi, bj, warps = QUERY_TILES
            head_gemv(q_nope, w_uk, q_latent, block_i=bi, block_j=bj, num_warps=warps)
        else:
            q_latent.copy_(torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1))
        out = self.backend.forward_mla(
            query, None, self.layer_id, batch, m.softmax_scale, m.kv_lora_rank
        )  # [n, heads, rank]
        o_in = torch.empty((n, h, m.v_head_dim), dtype=q.dtype, device=q.device)
        if small:
            bi, bj, warps = OUTPUT_TILES
            head_gemv(out, w_uv, o_in, block_i=bi, block_j=bj, num_warps=warps)
        else:
            o_in.copy_(torch.bmm(out.transpose(0, 1), w_uv).transpose(0, 1))
        return self.o_proj(o_in.view(n, h * m.v_head_dim))


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (its forward) with MLA and, past the first dense layers, MoE."""

    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_id, backend, tp)  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.moe is not None and config.moe.is_sparse(layer_id)
        if mla_of(config).is_moe_layer(layer_id) != sparse:  # two readings of one config
            raise ModelLoadError(
                f"{config.architecture}: layer {layer_id} is {'' if sparse else 'not '}sparse "
                "by its MoE config but the reverse by first_k_dense_replace/moe_layer_freq"
            )
        # Routed experts (DeepSeek's grouped top-k, shared experts) past the dense layers.
        self.mlp = build_mlp(config, layer_id, tp)
        if isinstance(self.mlp, SparseMoE):  # Llama's forward: the next norm sums the rows
            self.mlp.defer_sum = True


class DeepseekModel(LlamaModel):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        nn.Module.__init__(self)
        mla = mla_of(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, backend, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            mla.qk_rope_head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """`forward(batch)` -> last-token logits, as Llama's; the pool it reads is the latent one
    (kv_pool.make_kv_pool), and decode buffers are per head `kv_lora_rank` wide."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        nn.Module.__init__(self)
        mla = mla_of(config)
        self.config, self.backend, self.tp = config, backend, tp
        self.num_heads = HeadShards(config, tp).q  # this rank's
        self.num_kv_heads = 1  # one latent row per token, on every rank
        self.decode_value_dim = mla.kv_lora_rank  # what attention returns per head
        self.model = DeepseekModel(config, backend, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3's layers are V2's; its router (sigmoid, correction bias, grouped top-k) is what
    MoEConfig reads from its config."""
