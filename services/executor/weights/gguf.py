"""Reading GGUF files (llama.cpp's format): tensor names mapped to HF's, every tensor
dequantised to fp32 with the `gguf` package, Llama's Q/K rows put back in HF order, Gemma's
norm weights back to HF's zero-centred form (llama.cpp's converter adds the 1 of `1 + w`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from services.executor.errors import ModelLoadError, UnsupportedModelError
from services.executor.model_config import ModelConfig

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
}
# Gemma 2/3 name their four norms per layer apart from Llama's two.
_GEMMA_PER_LAYER = {
    **_PER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Read into ModelConfig.rope_scaling rather than loaded as a weight.
_CONFIG_TENSORS = {"rope_freqs.weight"}


def open_gguf(path: str) -> GGUFReader:
    """A memory-mapped reader; ModelLoadError naming `path` if it isn't a valid GGUF file."""
    try:
        return GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str:
    """HF parameter name of a GGUF tensor; unknown names come back unchanged (and are then
    reported as unexpected weights)."""
    per_layer = _GEMMA_PER_LAYER if architecture in _GEMMA else _PER_LAYER
    base, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{kind}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{kind}"
    return gguf_name


def iter_gguf_weights(
    reader: GGUFReader, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 CPU tensor) for every weight, dequantised one tensor at a time."""
    # llama.cpp permutes Llama's Q/K rows for its interleaved RoPE; Qwen's are left alone.
    unpermute = config.architecture == "LlamaForCausalLM"
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name} uses {t.tensor_type.name}, which cannot be dequantised: {e}"
            ) from e
        # ggml lists dimensions fastest-first; numpy/torch want them slowest-first.
        arr = np.ascontiguousarray(arr).reshape([int(d) for d in reversed(t.shape)])
        # F32 data is a read-only view of the mmap; torch wants a writable array.
        tensor = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        name = hf_name(t.name, config.architecture)
        if config.architecture in _GEMMA and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # never in place: F32 data may be the file's own memory
        if unpermute and t.name.split(".")[-2] == "attn_q":
            tensor = unpermute_qk(tensor, config.num_heads)
        elif unpermute and t.name.split(".")[-2] == "attn_k":
            tensor = unpermute_qk(tensor, config.num_kv_heads)
        yield name, tensor


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
