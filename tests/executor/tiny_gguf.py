"""Writing a tiny HF model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does:
its tensor names, its metadata keys, Llama's Q/K rows permuted, Llama-3 RoPE scaling as a
`rope_freqs` tensor, Phi-3's fused attn_qkv and ffn_up (gate and up) with its LongRoPE factors
as `rope_factors_long/short` tensors, optionally Q8_0-quantised matrices; DeepSeek as
`deepseek2`, its kv_b_proj split into attn_k_b / attn_v_b (newer converters) or whole (older
ones), its MoE layers with llama.cpp's router keys, shared experts, `exp_probs_b` correction
bias and stacked experts; Gemma 2/3 with their four norms per layer, the 1 of their `1 + w`
norms added to the stored weights, their window and softcaps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import PreTrainedModel

from .helpers import BOS_ID, EOS_ID, MERGES, make_tokenizer

_GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp converts Mixtral as a Llama with experts
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's, stacked [q; k; v]
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's, stacked [gate; up]
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",  # DeepSeek's, plain (no gate)
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# Kept in F32 whatever the file type, as llama.cpp's converter keeps them.
_ALWAYS_F32 = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    layer_names = _GEMMA_LAYER if arch.startswith("gemma") else _LAYER
    base, _, kind = hf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{layer_names[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows (half, i) -> (i, half)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_factors(head_dim: int, theta: float, rope: dict[str, float]) -> np.ndarray:
    """The divisors llama.cpp's converter stores as rope_freqs.weight for Llama 3."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_deepseek2_metadata(writer: gguf.GGUFWriter, cfg: Any, split_kv_b: bool) -> None:
    """llama.cpp's deepseek2 keys: split_kv_b, the newer converter's MQA view (one KV head of
    kv_lora_rank + rope, per-head widths under *_mla); else the older per-head one."""
    rope, nope, v = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(cfg.kv_lora_rank + rope)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_head_count_kv(cfg.num_attention_heads)
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_rope_dimension_count(rope)
    _add_deepseek2_moe(writer, cfg)
    params = cfg.rope_parameters
    if params.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def _add_deepseek2_moe(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """The MoE keys llama.cpp's DeepseekV2Model (and TextModel under it) writes. Its
    converter reads config.json, whose V3 `scoring_func` ("sigmoid") transformers' config
    drops."""
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts or 0)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:  # written only when set
        writer.add_expert_weights_norm(True)
    v3 = cfg.model_type == "deepseek_v3"
    scoring = getattr(cfg, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    writer.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID
        if scoring == "sigmoid"
        else gguf.ExpertGatingFuncType.SOFTMAX
    )
    if cfg.n_group is not None:
        writer.add_expert_group_count(cfg.n_group)
    if cfg.topk_group is not None:
        writer.add_expert_group_used_count(cfg.topk_group)


def _split_kv_b(w: np.ndarray, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj [heads * (nope + v), rank] -> (k_b [heads, rank, nope], v_b [heads, v, rank])."""
    nope = cfg.qk_nope_head_dim
    per_head = w.reshape(cfg.num_attention_heads, nope + cfg.v_head_dim, w.shape[1])
    k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
    return k_b, np.ascontiguousarray(per_head[:, nope:])


def write_tiny_gguf(
    path: Path,
    model: PreTrainedModel,
    arch: str,
    qtype: GGMLQuantizationType,
    split_kv_b: bool = True,
    types: dict[str, GGMLQuantizationType] | None = None,
) -> None:
    """Write `model` to `path`. With a quantised qtype, the model's own matrices are replaced
    by their dequantised values, so it holds exactly the weights the file does. split_kv_b:
    DeepSeek's kv_b_proj as attn_k_b + attn_v_b (else one attn_kv_b). types: another type
    for some matrices, by llama.cpp's name (blk.1.attn_v, or attn_v for every layer); Q4_K
    and Q6_K ones (which the gguf package cannot quantize) get random valid blocks instead of
    the model's values, and the model takes those."""
    cfg = model.config
    a = _GGUF_ARCH[arch]
    mla = a == "deepseek2"
    rope = cfg.rope_parameters
    if a == "gemma3":  # one RoPE per layer type; llama.cpp's key is the global one's
        local, rope = rope["sliding_attention"], rope["full_attention"]
        if local["rope_theta"] != 10000.0:
            writer_swa_base: float | None = local["rope_theta"]
        else:
            writer_swa_base = None
    writer = gguf.GGUFWriter(str(path), a)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    if mla:
        _add_deepseek2_metadata(writer, cfg, split_kv_b)
    elif a == "phi3":  # no key_length: the reader derives head_dim from the widths
        writer.add_head_count_kv(cfg.num_key_value_heads)
        _add_phi3(writer, cfg)
    else:
        writer.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = cfg.head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(0 if qtype == GGMLQuantizationType.F32 else 7)  # ALL_F32 / MOSTLY_Q8_0
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts and not mla:  # DeepSeek's: _add_deepseek2_moe
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if a != "llama":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        shared = getattr(cfg, "shared_expert_intermediate_size", 0)
        if shared:
            writer.add_expert_shared_feed_forward_length(shared)
    _add_tokenizer(writer)
    if a.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if a == "gemma2" and cfg.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if a == "gemma3" and writer_swa_base is not None:
            writer.add_rope_freq_base_swa(writer_swa_base)
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        default = [(i + 1) % (2 if a == "gemma2" else 6) != 0 for i in range(len(sliding))]
        if sliding != default:  # llama.cpp's fixed layout does not fit: one flag per layer
            writer.add_sliding_window_pattern(sliding)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", _llama3_rope_factors(cfg.head_dim, rope["rope_theta"], rope)
        )
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            data = param.float().numpy()
            if mla and split_kv_b and ".kv_b_proj." in name:
                k_b, v_b = _split_kv_b(data, cfg)
                layer = gguf_name(name).split(".")[1]
                writer.add_tensor(f"blk.{layer}.attn_k_b.weight", k_b)
                writer.add_tensor(f"blk.{layer}.attn_v_b.weight", v_b)
                continue
            if name.endswith("e_score_correction_bias"):  # V3's router bias, kept F32
                layer = name.split(".")[2]
                writer.add_tensor(f"blk.{layer}.exp_probs_b.bias", np.ascontiguousarray(data))
                continue
            if ".mlp.experts." in name or name.endswith("shared_expert_gate.weight"):
                _write_moe_tensor(writer, name, param, qtype)
                continue
            stored = data
            if a == "llama" and ".q_proj." in name:
                stored = llama_cpp_permute(data, cfg.num_attention_heads)
            elif a == "llama" and ".k_proj." in name:
                stored = llama_cpp_permute(data, cfg.num_key_value_heads)
            elif a.startswith("gemma") and name.endswith("norm.weight"):
                stored = data + 1.0  # llama.cpp stores Gemma's norms as 1 + w
            quantized = data.ndim == 2 and not name.endswith(_ALWAYS_F32)
            base = gguf_name(name, a).rsplit(".", 1)[0]  # blk.1.attn_v
            qt = (types or {}).get(base, (types or {}).get(base.split(".")[-1], qtype))
            if quantized and qt in _RANDOM_BLOCKS:
                writer.add_tensor(gguf_name(name, a), _random_kquant(param, name, qt, cfg, a),
                                  raw_dtype=qt)  # fmt: skip
            elif quantized and qt != GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name(name, a), quantize(stored, qt), raw_dtype=qt)
                # Blocks run along rows and the permutation only moves whole rows, so
                # this is the file's tensor in HF row order.
                param.copy_(torch.from_numpy(dequantize(quantize(data, qt), qt)))
            else:
                writer.add_tensor(gguf_name(name, a), np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_RANDOM_BLOCKS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)


def _random_kquant(
    param: torch.Tensor, name: str, qtype: GGMLQuantizationType, cfg: Any, arch: str
) -> np.ndarray:
    """Random blocks of `qtype` as the file stores them (Llama's Q/K rows permuted); `param`
    takes their weights in HF's row order."""
    from services.executor.quant.gguf_linear import dummy_blocks
    from services.executor.weights.gguf import unpermute_qk

    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    blocks = dummy_blocks(
        param.shape[0], param.shape[1], qtype.name, gen, std=0.1
    )  # as make_hf_model
    weights = torch.from_numpy(dequantize(blocks.numpy(), qtype)).reshape(param.shape)
    if arch == "llama" and ".q_proj." in name:
        weights = unpermute_qk(weights, cfg.num_attention_heads)
    elif arch == "llama" and ".k_proj." in name:
        weights = unpermute_qk(weights, cfg.num_key_value_heads)
    param.copy_(weights)
    return blocks.numpy()


def _add_phi3(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Phi-3's metadata and LongRoPE tensors as llama.cpp's Phi3MiniModel writes them."""
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
    writer.add_rope_dimension_count(rope_dims // cfg.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") != "longrope":
        return
    scale = cfg.max_position_embeddings / original
    attn_factor = rope.get("attention_factor") or (
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    )
    writer.add_rope_scaling_attn_factors(attn_factor)
    for kind in ("long", "short"):
        factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def _write_moe_tensor(
    writer: gguf.GGUFWriter, name: str, param: torch.Tensor, qtype: GGMLQuantizationType
) -> None:
    """transformers' stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as
    llama.cpp's ffn_{gate,up,down}_exps; Qwen2-MoE's shared_expert_gate [1, H] as the 1-D
    ffn_gate_inp_shexp. `param` takes the values the file holds."""
    layer = name.split(".")[2]  # model.layers.N....
    data = param.float().numpy()
    if name.endswith("shared_expert_gate.weight"):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp_shexp.weight", data.reshape(-1))
        return

    def put(kind: str, array: np.ndarray) -> np.ndarray:
        array = np.ascontiguousarray(array)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(f"blk.{layer}.{kind}.weight", array)
            return array
        writer.add_tensor(f"blk.{layer}.{kind}.weight", quantize(array, qtype), raw_dtype=qtype)
        return dequantize(quantize(array, qtype), qtype).reshape(array.shape)

    if name.endswith("gate_up_proj"):
        inter = data.shape[1] // 2
        gate = put("ffn_gate_exps", data[:, :inter])
        up = put("ffn_up_exps", data[:, inter:])
        param.copy_(torch.from_numpy(np.concatenate([gate, up], axis=1)))
    else:
        param.copy_(torch.from_numpy(put("ffn_down_exps", data)))


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The tiny byte-level BPE tokenizer in llama.cpp's "gpt2" form."""
    vocab = make_tokenizer().get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([control if vocab[t] >= BOS_ID else normal for t in tokens])
    writer.add_token_merges([f"{x} {y}" for x, y in MERGES])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
