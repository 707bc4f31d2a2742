"""The shape of a decoder-only model, read from a HF config.json or from GGUF metadata.

Both sources end up in the same `ModelConfig`, so model code never looks at either format.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from services.executor.architectures import check_architecture
from services.executor.errors import ModelLoadError, UnsupportedModelError
from services.executor.moe_config import MoEConfig

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# A llama GGUF with routed experts (ffn_gate_exps) is Mixtral.
_GGUF_MOE_ARCHITECTURES = {"LlamaForCausalLM": "MixtralForCausalLM"}

# HF `model_type` -> architecture, for config.json files without an `architectures` list.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# Architectures with q/k/v biases (HF has no flag for Qwen2's; Qwen2-MoE's is `qkv_bias`)
# and with per-head q/k norms.
_QKV_BIAS = {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM"}
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}

# "freq_factors" is llama.cpp's form of llama3 scaling: per-frequency divisors in a tensor.
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "freq_factors")

_HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

# GGUF `general.file_type` -> the dtype its float tensors were stored in.
_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code and the KV pool need to know about a checkpoint.

    rope_scaling is None for plain RoPE, else a dict with "rope_type" in SUPPORTED_ROPE_TYPES
    and that type's HF parameters ("factor", "low_freq_factor", ...).
    """

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int  # the context length
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2; Llama/Qwen3 optionally)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # e.g. "bfloat16": the dtype the weights were published in
    o_proj_bias: bool = False  # HF's Llama/Qwen3 `attention_bias` covers o_proj too; Qwen2's not
    mlp_bias: bool = False  # Llama's `mlp_bias`: biases on gate/up/down
    moe: MoEConfig | None = None  # routed experts (moe_config.py); None: a dense model

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope scaling {rope_type!r} in {self.architecture}; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read `path/config.json` (and eos ids from `generation_config.json` if present)."""
        cfg = _read_json(os.path.join(path, "config.json"), required=True)
        gen = _read_json(os.path.join(path, "generation_config.json"), required=False)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), "")
        if not arch:
            raise UnsupportedModelError(
                f"{path}/config.json names no architecture (model_type "
                f"{cfg.get('model_type')!r}); supported: {', '.join(_MODEL_TYPES.values())}"
            )
        check_architecture(arch)
        missing = [k for k in _HF_REQUIRED if k not in cfg]
        if missing:
            raise ModelLoadError(f"{path}/config.json lacks {', '.join(missing)}")
        rope_theta, rope_scaling = _hf_rope(cfg)
        bias = bool(cfg.get("attention_bias", False))
        num_heads = cfg["num_attention_heads"]
        context = cfg.get("max_position_embeddings", 2048)
        # We only do full attention: a sliding-window model is exact up to its window.
        window = cfg.get("sliding_window")
        sliding = arch in ("MistralForCausalLM", "MixtralForCausalLM")
        if window and (sliding or cfg.get("use_sliding_window")):
            context = min(context, window)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # HF's Qwen2 always has q/k/v biases (never o_proj's) and has no flag for them.
            attention_bias=bool(cfg.get("qkv_bias", True)) if arch in _QKV_BIAS else bias,
            qk_norm=arch in _QK_NORM,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_id_tuple(cfg.get("eos_token_id"), gen.get("eos_token_id")),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            o_proj_bias=arch not in _QKV_BIAS and bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            moe=MoEConfig.from_hf(cfg),
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> ModelConfig:
        """Read the metadata of an open `gguf.GGUFReader` (keys as llama.cpp writes them)."""
        fields = reader.fields
        source = getattr(reader.data, "filename", "GGUF file")

        def get(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        def need(key: str) -> int:
            if key not in fields:
                raise ModelLoadError(f"{source}: GGUF metadata lacks {key}")
            return int(fields[key].contents())

        gguf_arch = get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {gguf_arch!r}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ModelLoadError(f"{source}: GGUF file has no token_embd.weight tensor")
        a = gguf_arch
        hidden = need(f"{a}.embedding_length")
        num_heads = need(f"{a}.attention.head_count")
        num_layers = need(f"{a}.block_count")
        moe = MoEConfig.from_gguf(get, a, tensors, num_layers)
        # MoE GGUFs may leave out the dense size when every layer is sparse.
        ffn = f"{a}.feed_forward_length"
        dense_inter = int(get(ffn, 0)) if moe is not None else need(ffn)
        arch = GGUF_ARCHITECTURES[a]
        if moe is not None:
            arch = _GGUF_MOE_ARCHITECTURES.get(arch, arch)
        return cls(
            architecture=arch,
            # ggml shapes list the fastest-varying dimension first: [hidden, vocab].
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=dense_inter,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(get(f"{a}.attention.head_count_kv", num_heads)),
            head_dim=int(get(f"{a}.attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(get, a, tensors),
            max_position_embeddings=int(get(f"{a}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_id_tuple(
                get("tokenizer.ggml.eos_token_id"), get("tokenizer.ggml.eot_token_id")
            ),
            torch_dtype=_GGUF_FILE_TYPES.get(get("general.file_type", 0), "float32"),
            o_proj_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_up.bias" in tensors,
            moe=moe,
        )


def _read_json(path: str, *, required: bool) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        if required:
            raise ModelLoadError(f"model config not found: {path}") from None
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read model config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"model config {path} is not a JSON object")
    return data


def _id_tuple(*sources: int | list[int] | None) -> tuple[int, ...]:
    """Token ids from several "an id, a list of ids or None" sources, in order, deduplicated."""
    out: list[int] = []
    for ids in sources:
        if ids is not None:
            out.extend([int(ids)] if isinstance(ids, int) else (int(i) for i in ids))
    return tuple(dict.fromkeys(out))


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers<5 (`rope_theta`, `rope_scaling`) or >=5 configs
    (`rope_parameters`, which holds theta, the type and its parameters together)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    rope_type = params.pop("rope_type", None) or params.pop("type", None)
    if rope_type in (None, "default"):
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _gguf_rope(get: Any, arch: str, tensors: dict[str, Any]) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes Llama-3 scaling into a [head_dim / 2] tensor of frequency divisors.
        factors = [float(x) for x in tensors["rope_freqs.weight"].data.reshape(-1)]
        return {"rope_type": "freq_factors", "freq_factors": factors}
    rope_type = get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    return {"rope_type": rope_type, "factor": float(get(f"{arch}.rope.scaling.factor", 1.0))}
