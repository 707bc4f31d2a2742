"""Reading GGUF files (llama.cpp's format): tensor names mapped to HF's, every tensor
dequantised to fp32 with the `gguf` package (or, for the projections the model keeps as
blocks, quant/gguf_config.py, given as the file's bytes), Llama's Q/K rows put back in HF order,
DeepSeek's kv_b_proj put back together where newer converters split it (attn_k_b, attn_v_b),
Gemma's norm weights back to HF's zero-centred form (llama.cpp's converter adds the 1 of
`1 + w`), the stacked `ffn_*_exps` of MoE models split into HF's per-expert tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from services.executor.errors import ModelLoadError, UnsupportedModelError
from services.executor.model_config import ModelConfig
from shared.model_files import gguf_reader

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# blk.N.<key> -> model.layers.N.<value>
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's stacked [q; k; v], split by the loader
    # deepseek2 (MLA); its V2-Lite form has a plain attn_q
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # MoE (qwen2moe, qwen3moe, Mixtral as llama): the router and Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 2/3 name their four norms per layer apart from Llama's two.
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# DeepSeek's plain shared experts (n_shared of them as one MLP) and V3's router bias; a key
# with its kind ("exp_probs_b.bias") names the whole HF parameter.
_DEEPSEEK_MOE = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# Where an architecture's tensor of that name holds something else: Phi-3's ffn_up is its
# stacked [gate; up] (llama.cpp has no ffn_gate for it); Gemma's norms; DeepSeek's experts.
_PER_LAYER_BY_ARCH = {
    "Phi3ForCausalLM": {"ffn_up": "mlp.gate_up_proj"},
    **dict.fromkeys(_GEMMA, _GEMMA_NORMS),
    **dict.fromkeys(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"), _DEEPSEEK_MOE),
}
# Halves of kv_b_proj, per head: k_b [heads, kv_lora_rank, nope] (transposed) and
# v_b [heads, v_head_dim, kv_lora_rank].
_KV_B_HALVES = ("attn_k_b", "attn_v_b")
# blk.N.<key> [experts, ...] -> model.layers.N.mlp.experts.E.<value>, one tensor per expert
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# architectures whose Q/K rows llama.cpp permutes (Mixtral goes through its Llama converter)
_PERMUTED_QK = ("LlamaForCausalLM", "MixtralForCausalLM")
# Read into ModelConfig.rope_scaling rather than loaded as a weight.
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def open_gguf(path: str) -> GGUFReader:
    """A memory-mapped reader; ModelLoadError naming `path` if it isn't a valid GGUF file."""
    try:
        reader: GGUFReader = gguf_reader(path)
        return reader
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def hf_name(gguf_name: str, architecture: str = "") -> str:
    """HF parameter name of a GGUF tensor of a model of `architecture` (HF's name); unknown
    names come back unchanged (and are then reported as unexpected weights)."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{kind}"
    parts = base.split(".", 2)
    per_layer = {**_PER_LAYER, **_PER_LAYER_BY_ARCH.get(architecture, {})}
    if len(parts) != 3 or parts[0] != "blk":
        return gguf_name
    if f"{parts[2]}.{kind}" in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[f'{parts[2]}.{kind}']}"
    if parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{kind}"
    return gguf_name


def iter_gguf_weights(
    reader: GGUFReader, config: ModelConfig, blocks: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 CPU tensor) for every weight, dequantised one tensor at a time; a
    stacked experts tensor is given as HF's per-expert tensors (views of it). The weights
    named in `blocks` come as the file's bytes instead, uint8 [rows, row bytes] (one row of
    blocks per row of weights, so Q/K rows are un-permuted the same way)."""
    # llama.cpp permutes Llama's Q/K rows for its interleaved RoPE; Qwen's are left alone.
    unpermute = config.architecture in _PERMUTED_QK
    names = {t.name for t in reader.tensors}
    halves: dict[tuple[str, str], torch.Tensor] = {}  # (block, half) -> tensor
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        parts = t.name.split(".")
        half = parts[2] if len(parts) == 4 and parts[0] == "blk" else ""
        if half in _KV_B_HALVES and f"blk.{parts[1]}.attn_kv_b.weight" in names:
            continue  # the file has the whole kv_b too (some converters keep both)
        name = hf_name(t.name, config.architecture)
        # blocks: a copy of the file's bytes (its mmap is read-only)
        tensor = torch.from_numpy(np.array(t.data)) if name in blocks else _dequantized(t)
        if half in _KV_B_HALVES:
            halves[(parts[1], half)] = tensor
            if all((parts[1], h) in halves for h in _KV_B_HALVES):
                k_b, v_b = (halves.pop((parts[1], h)) for h in _KV_B_HALVES)
                yield f"model.layers.{parts[1]}.self_attn.kv_b_proj.weight", merge_kv_b(k_b, v_b)
            continue
        if half in _EXPERTS:  # blk.N.ffn_*_exps.weight
            prefix = f"model.layers.{parts[1]}.mlp.experts"
            for index, expert in enumerate(tensor):
                yield f"{prefix}.{index}.{_EXPERTS[half]}.weight", expert
            continue
        if half == "ffn_gate_inp_shexp":  # stored as [hidden]
            tensor = tensor.reshape(1, -1)
        if config.architecture in _GEMMA and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # never in place: F32 data may be the file's own memory
        if unpermute and t.name.split(".")[-2] == "attn_q":
            tensor = unpermute_qk(tensor, config.num_heads)
        elif unpermute and t.name.split(".")[-2] == "attn_k":
            tensor = unpermute_qk(tensor, config.num_kv_heads)
        yield name, tensor


def _dequantized(t: ReaderTensor) -> torch.Tensor:
    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"GGUF tensor {t.name} uses {t.tensor_type.name}, which cannot be dequantised: {e}"
        ) from e
    # ggml lists dimensions fastest-first; numpy/torch want them slowest-first.
    arr = np.ascontiguousarray(arr).reshape([int(d) for d in reversed(t.shape)])
    # F32 data is a read-only view of the mmap; torch wants a writable array.
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF's kv_b_proj [heads * (nope + v), kv_lora_rank] from llama.cpp's halves k_b
    [heads, kv_lora_rank, nope] and v_b [heads, v, kv_lora_rank]."""
    rank = k_b.shape[1]
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, rank)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of a Q/K weight [heads * head_dim, ...] (or bias).

    HF orders each head's rows (half, i) for rotate-half RoPE; llama.cpp reorders them to
    (i, half) so rotated pairs are adjacent. Swapping the two axes back restores HF's order.
    """
    shape = w.shape
    return (
        w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
        .transpose(1, 2)
        .reshape(shape)
    )
