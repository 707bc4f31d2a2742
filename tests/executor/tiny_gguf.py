"""Writing a tiny HF model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does:
its tensor names, its metadata keys, Llama's Q/K rows permuted, Llama-3 RoPE scaling as a
`rope_freqs` tensor, optionally Q8_0-quantised matrices; Gemma 2/3 with their four norms per
layer, the 1 of their `1 + w` norms added to the stored weights, their window and softcaps.
"""

from __future__ import annotations

import math
from pathlib import Path

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
}
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


def write_tiny_gguf(
    path: Path, model: PreTrainedModel, arch: str, qtype: GGMLQuantizationType
) -> None:
    """Write `model` to `path`. With a quantised qtype, the model's own matrices are replaced
    by their dequantised values, so it holds exactly the weights the file does."""
    cfg = model.config
    a = _GGUF_ARCH[arch]
    head_dim = cfg.head_dim
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
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(0 if qtype == GGMLQuantizationType.F32 else 7)  # ALL_F32 / MOSTLY_Q8_0
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
            "rope_freqs.weight", _llama3_rope_factors(head_dim, rope["rope_theta"], rope)
        )
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            data = param.float().numpy()
            stored = data
            if a == "llama" and ".q_proj." in name:
                stored = llama_cpp_permute(data, cfg.num_attention_heads)
            elif a == "llama" and ".k_proj." in name:
                stored = llama_cpp_permute(data, cfg.num_key_value_heads)
            elif a.startswith("gemma") and name.endswith("norm.weight"):
                stored = data + 1.0  # llama.cpp stores Gemma's norms as 1 + w
            if data.ndim == 2 and qtype != GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name(name, a), quantize(stored, qtype), raw_dtype=qtype)
                # Blocks run along rows and the permutation only moves whole rows, so
                # this is the file's tensor in HF row order.
                param.copy_(torch.from_numpy(dequantize(quantize(data, qtype), qtype)))
            else:
                writer.add_tensor(gguf_name(name, a), np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
