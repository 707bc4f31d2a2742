"""The shape of a decoder-only model, read from a HF config.json or from GGUF metadata.

Both sources end up in the same `ModelConfig`, so model code never looks at either format.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from services.executor.architectures import check_architecture
from services.executor.errors import ModelLoadError, UnsupportedModelError
from services.executor.mla_config import YARN_TYPES, MLAConfig
from services.executor.moe_config import MoEConfig

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3 too: llama.cpp converts both to deepseek2
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
    "phi3": "Phi3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Architectures with q/k/v biases (HF has no flag for Qwen2's; Qwen2-MoE's is `qkv_bias`)
# and with per-head q/k norms.
_QKV_BIAS = {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM"}
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}

# "freq_factors" is llama.cpp's form of llama3 scaling: per-frequency divisors in a tensor.
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "freq_factors", "longrope", "yarn", "deepseek_yarn")
# What ModelConfig.rope_scaling holds for LongRoPE (Phi-3), from config.json or GGUF alike.
_LONGROPE_KEYS = (
    "short_factor",
    "long_factor",
    "original_max_position_embeddings",
    "attention_factor",
)

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
    and that type's HF parameters ("factor", "low_freq_factor", ...); for "longrope" exactly
    _LONGROPE_KEYS, the attention factor resolved (kernels/rope_freq.py picks the factors).
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
    # RoPE rotates the first rotary_dim dims of each head (Phi-4-mini: 3/4 of them); 0 given
    # means all of head_dim, which is what the field then holds.
    rotary_dim: int = 0
    # DeepSeek's latent attention; then head_dim is a query/key head's width (nope + rope)
    # and num_kv_heads == num_heads, as HF's config says, though the pool holds one latent.
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None  # routed experts (moe_config.py); None: a dense model

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)  # frozen: set once, here
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelLoadError(
                f"rotary dims {self.rotary_dim} (partial_rotary_factor) must be even and at "
                f"most head_dim {self.head_dim}"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope scaling {rope_type!r} in {self.architecture}; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            if rope_type == "longrope":
                _check_longrope(self.rope_scaling, self.rotary_dim)
            if rope_type in YARN_TYPES and self.mla is None:
                # YaRN's attention factor on cos/sin is applied by the MLA layer only.
                raise UnsupportedModelError(
                    f"rope scaling {rope_type!r} in {self.architecture}: supported for "
                    "DeepSeek's latent attention only"
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
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        context = cfg.get("max_position_embeddings", 2048)
        # We only do full attention: a sliding-window model is exact up to its window.
        window = cfg.get("sliding_window")
        if window and (arch in _SLIDING_ARCHS or cfg.get("use_sliding_window")):
            context = min(context, window)
        mla = MLAConfig.from_hf(cfg, rope_scaling) if arch in _MLA_ARCHITECTURES else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=mla.qk_head_dim if mla else head_dim,
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
            # MLA rotates its own rope part (MLAConfig); the dense layers' RoPE is not used.
            rotary_dim=mla.qk_rope_head_dim if mla else int(head_dim * _partial_rotary_factor(cfg)),
            mla=mla,
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
        context = int(get(f"{a}.context_length", 2048))
        served = context
        window = int(get(f"{a}.attention.sliding_window", 0))
        if a == "phi3" and window > 0:  # full attention, exact up to the window (as from HF)
            served = min(context, window)
        rope_scaling = _gguf_rope(get, a, tensors, context)
        mla = _gguf_mla(get, need, a, rope_scaling) if a == "deepseek2" else None
        num_layers = need(f"{a}.block_count")
        moe = MoEConfig.from_gguf(get, a, tensors, num_layers)
        if moe is not None and a == "deepseek2":
            raise UnsupportedModelError(
                f"{source}: GGUF deepseek2 with routed experts: DeepSeek's router (its grouped "
                "top-k and correction bias) is not read from GGUF metadata yet; serve the "
                "Hugging Face checkpoint"
            )
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
            # MLA: HF's view (every head has its K/V), not llama.cpp's MQA over the latent.
            num_kv_heads=num_heads if mla else int(get(f"{a}.attention.head_count_kv", num_heads)),
            head_dim=mla.qk_head_dim
            if mla
            else int(get(f"{a}.attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=served,
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
            rotary_dim=int(get(f"{a}.rope.dimension_count", 0)),
            mla=mla,
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


# Architectures whose config's sliding_window always applies (Qwen2's only with a flag).
_SLIDING_ARCHS = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers<5 (`rope_theta`, `rope_scaling`) or >=5 configs
    (`rope_parameters`, which holds theta, the type and its parameters together)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    params.pop("partial_rotary_factor", None)  # not scaling: ModelConfig.rotary_dim
    rope_type = params.pop("rope_type", None) or params.pop("type", None)
    params.pop("type", None)
    if rope_type in (None, "default"):
        return theta, None
    # Phi-3's early configs call LongRoPE "su" (transformers reads "yarn" with factors so too).
    if rope_type == "su" or (rope_type == "yarn" and "long_factor" in params):
        rope_type = "longrope"
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings")
        original = original or cfg.get("original_max_position_embeddings")
        if not original:
            raise ModelLoadError("longrope scaling needs original_max_position_embeddings")
        context = cfg.get("max_position_embeddings", 2048)
        return theta, _longrope(params, int(original), context)
    return theta, {"rope_type": rope_type, **params}


def _longrope(params: dict[str, Any], original: int, context: int) -> dict[str, Any]:
    """rope_scaling for LongRoPE. The attention factor that scales cos and sin is the
    config's, else transformers' default from the scale factor (the config's `factor`, else
    max_position_embeddings / original; `context` is the unclamped max_position_embeddings).
    """
    missing = [k for k in ("short_factor", "long_factor") if k not in params]
    if missing:
        raise ModelLoadError(f"longrope scaling lacks {', '.join(missing)}")
    factor = float(params.get("factor") or context / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        )
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in params["short_factor"]],
        "long_factor": [float(f) for f in params["long_factor"]],
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


def _check_longrope(scaling: dict[str, Any], rotary_dim: int) -> None:
    missing = [k for k in _LONGROPE_KEYS if k not in scaling]
    if missing:
        raise ModelLoadError(f"longrope scaling lacks {', '.join(missing)}")
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != rotary_dim // 2:
            raise ModelLoadError(
                f"longrope {key} has {len(scaling[key])} entries; the {rotary_dim} rotary "
                f"dims need {rotary_dim // 2}"
            )


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """The share of each head RoPE rotates: top-level (transformers<5, Phi-4-mini's
    config.json) or inside rope_parameters (transformers>=5)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    return float(factor)


def _gguf_rope(get: Any, arch: str, tensors: dict[str, Any], context: int) -> dict[str, Any] | None:
    if "rope_factors_long.weight" in tensors:
        # llama.cpp keeps Phi-3's LongRoPE factors as two [rotary_dim / 2] tensors.
        key = f"{arch}.rope.scaling.original_context_length"
        if get(key) is None:
            raise ModelLoadError(f"GGUF file has rope_factors_long but no {key}")
        params: dict[str, Any] = {
            name: [float(x) for x in tensors[f"rope_factors_{kind}.weight"].data.reshape(-1)]
            for name, kind in (("long_factor", "long"), ("short_factor", "short"))
            if f"rope_factors_{kind}.weight" in tensors
        }
        attn_factor = get(f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            params["attention_factor"] = float(attn_factor)
        return _longrope(params, int(get(key)), context)
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes Llama-3 scaling into a [head_dim / 2] tensor of frequency divisors.
        factors = [float(x) for x in tensors["rope_freqs.weight"].data.reshape(-1)]
        return {"rope_type": "freq_factors", "freq_factors": factors}
    rope_type = get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling = {"rope_type": rope_type, "factor": float(get(f"{arch}.rope.scaling.factor", 1.0))}
    if rope_type == "yarn":
        old = get(f"{arch}.rope.scaling.original_context_length")
        if old is None:
            raise ModelLoadError(
                f"GGUF YaRN scaling without {arch}.rope.scaling.original_context_length"
            )
        scaling["original_max_position_embeddings"] = int(old)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"{arch}.rope.scaling.{key}") is not None:
                scaling[name] = float(get(f"{arch}.rope.scaling.{key}"))
        # llama.cpp keeps DeepSeek's 0.1 * mscale_all_dim, and assumes mscale equals it.
        log_mul = get(f"{arch}.rope.scaling.yarn_log_multiplier")
        if log_mul:
            scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / 0.1
    return scaling


def _gguf_mla(get: Any, need: Any, arch: str, rope_scaling: dict[str, Any] | None) -> MLAConfig:
    """llama.cpp's deepseek2 metadata. Newer converters describe MLA as MQA over the latent
    (key_length = kv_lora_rank + rope, value_length = kv_lora_rank) and give the per-head
    widths as key_length_mla / value_length_mla; older ones give those as key_length and
    value_length."""
    rope = need(f"{arch}.rope.dimension_count")
    key = get(f"{arch}.attention.key_length_mla") or need(f"{arch}.attention.key_length")
    value = get(f"{arch}.attention.value_length_mla") or need(f"{arch}.attention.value_length")
    q_lora = get(f"{arch}.attention.q_lora_rank")
    return MLAConfig.build(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=need(f"{arch}.attention.kv_lora_rank"),
        qk_nope_head_dim=int(key) - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(value),
        rope_interleave=True,  # llama.cpp runs deepseek2 with interleaved ("norm") RoPE
        rope_scaling=rope_scaling,
        first_k_dense_replace=int(get(f"{arch}.leading_dense_block_count", 0)),
        moe_layer_freq=1,
        n_routed_experts=get(f"{arch}.expert_count"),
    )
