"""The shape of a decoder-only model, read from a HF config.json or from GGUF metadata.

Both sources end up in the same `ModelConfig`, so model code never looks at either format.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.executor.architectures import check_architecture
from services.executor.errors import ModelLoadError, UnsupportedModelError
from services.executor.mla_config import YARN_TYPES, MLAConfig
from services.executor.moe_config import MoEConfig
from services.executor.quant.registry import from_hf_config as quant_from_hf

if TYPE_CHECKING:  # torch: `radixserve serve` reads a checkpoint's config before it starts
    from services.executor.quant.base import QuantConfig

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3 too: llama.cpp converts both to deepseek2
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
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
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Architectures with q/k/v biases (HF has no flag for Qwen2's; Qwen2-MoE's is `qkv_bias`)
# and with per-head q/k norms.
_QKV_BIAS = {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM"}
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"}

# Families whose sliding-window layers really attend through their window (a mask over a KV
# cache that keeps every token): their context is not cut to the window.
WINDOWED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

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

_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

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
    # --- Gemma 2/3 (defaults: what every other family does) ---
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    sliding_window: int | None = None  # a sliding layer's query at p sees keys > p - window
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends through the window; () none
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    # the checkpoint's weight format (quant/registry.py); None: float weights
    quantization: QuantConfig | None = None

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer_id: int) -> int | None:
        """The layer's sliding window, None for full attention."""
        sliding = self.sliding_layers and self.sliding_layers[layer_id]
        return self.sliding_window if sliding else None

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
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported activation {self.hidden_act!r} in {self.architecture}; "
                f"supported: {', '.join(_ACTIVATIONS)}"
            )
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ModelLoadError(
                f"{len(self.sliding_layers)} layer types for {self.num_layers} layers"
            )
        if any(self.sliding_layers) and not (self.sliding_window and self.sliding_window > 0):
            raise ModelLoadError("sliding-window layers need a positive sliding_window")

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
        mla = MLAConfig.from_hf(cfg, rope_scaling) if arch in _MLA_ARCHITECTURES else None
        gemma = _hf_gemma(arch, cfg, path) if arch in WINDOWED_ARCHITECTURES else {}
        if gemma:
            rope_theta, rope_scaling = gemma.pop("rope")
        windows = gemma or _hf_windows(arch, cfg)
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
            quantization=quant_from_hf(cfg.get("quantization_config"), os.fspath(path)),
            **windows,
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
        window = int(get(f"{a}.attention.sliding_window", 0))
        windows: dict[str, Any] = {}
        if a == "phi3" and 0 < window < context:  # every layer, as from config.json
            windows = {
                "sliding_window": window,
                "sliding_layers": (True,) * need(f"{a}.block_count"),
            }
        rope_scaling = _gguf_rope(get, a, tensors, context)
        num_layers = need(f"{a}.block_count")
        moe = MoEConfig.from_gguf(get, a, tensors, num_layers)
        mla = _gguf_mla(get, need, a, rope_scaling, moe) if a == "deepseek2" else None
        # MoE GGUFs may leave out the dense size when every layer is sparse.
        ffn = f"{a}.feed_forward_length"
        dense_inter = int(get(ffn, 0)) if moe is not None else need(ffn)
        arch = GGUF_ARCHITECTURES[a]
        if moe is not None:
            arch = _GGUF_MOE_ARCHITECTURES.get(arch, arch)
        head_dim = int(get(f"{a}.attention.key_length", hidden // num_heads))
        gemma: dict[str, Any] = {}
        if a in ("gemma2", "gemma3"):
            gemma = _gguf_gemma(get, a, num_layers, hidden // num_heads, head_dim)
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
            head_dim=mla.qk_head_dim if mla else head_dim,
            rms_norm_eps=float(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{a}.rope.freq_base", 1e6 if a == "gemma3" else 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
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
            **(gemma or windows),
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


# Architectures whose config's sliding_window applies to every layer (Qwen2's only with a
# flag, and from max_window_layers on).
_SLIDING_ARCHS = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")


def _hf_windows(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's sliding_window / sliding_layers for the families that are not Gemma, as
    transformers masks them: config.json's `layer_types` where it has them (transformers 5
    writes them), else every layer of Mistral, Mixtral and Phi-3, and Qwen2's layers from
    `max_window_layers` on when `use_sliding_window` is set. A window no shorter than the
    context changes nothing and is left out. The KV pool keeps every token either way: the
    window is a mask, and the whole context is served."""
    window = cfg.get("sliding_window")
    num_layers = cfg["num_hidden_layers"]
    if not window or window >= cfg.get("max_position_embeddings", 2048):
        return {}
    types = cfg.get("layer_types")
    if types is not None:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"{arch}: unsupported layer types {sorted(unknown)}")
        sliding = tuple(t == "sliding_attention" for t in types)
    elif arch in _SLIDING_ARCHS:
        sliding = (True,) * num_layers
    elif cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers") or 0)
        sliding = tuple(i >= first for i in range(num_layers))
    else:
        return {}
    return {"sliding_window": int(window), "sliding_layers": sliding} if any(sliding) else {}


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


def _gguf_mla(
    get: Any, need: Any, arch: str, rope_scaling: dict[str, Any] | None, moe: MoEConfig | None
) -> MLAConfig:
    """llama.cpp's deepseek2 metadata. Newer converters describe MLA as MQA over the latent
    (key_length = kv_lora_rank + rope, value_length = kv_lora_rank) and give the per-head
    widths as key_length_mla / value_length_mla; older ones give those as key_length and
    value_length. Which layers are MoE is `moe`'s (a tail of the layers: MoEConfig.from_gguf
    checks it against leading_dense_block_count), so the two configs agree."""
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
        first_k_dense_replace=(
            moe.sparse_layers[0] if moe else int(get(f"{arch}.leading_dense_block_count", 0))
        ),
        moe_layer_freq=1,
        n_routed_experts=moe.num_experts if moe else None,
    )


# Gemma's defaults where config.json leaves a field out (transformers' config classes').
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "pattern": 2,
        "rope_theta": 10000.0,
    },
    "Gemma3ForCausalLM": {
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "pattern": 6,
        "rope_theta": 1_000_000.0,
    },
}


def _hf_gemma(arch: str, cfg: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """ModelConfig's Gemma fields from a Gemma 2/3 config.json, plus "rope": (theta, scaling)
    of the global layers. Reads transformers<5 keys (`rope_local_base_freq`,
    `sliding_window_pattern`) and >=5 ones (`layer_types`, per-layer-type `rope_parameters`)."""
    defaults = _GEMMA_DEFAULTS[arch]
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            f"{path}: bidirectional {arch} (an embedding model) is not supported"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or defaults["pattern"])
        sliding = tuple(bool((i + 1) % pattern) for i in range(num_layers))
    else:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"{path}: unsupported layer types {sorted(unknown)}")
        sliding = tuple(t == "sliding_attention" for t in types)
    window = cfg.get("sliding_window")
    params = cfg.get("rope_parameters") or {}
    local_theta: float | None = None
    if "full_attention" in params:  # transformers>=5 Gemma 3: one RoPE per layer type
        theta, scaling = _hf_rope({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{path}: scaled RoPE on sliding layers is not supported")
        local_theta = float(local.get("rope_theta", 10000.0))
    else:
        theta, scaling = _hf_rope(cfg)
        if not cfg.get("rope_theta") and "rope_theta" not in params:
            theta = defaults["rope_theta"]
        if arch == "Gemma3ForCausalLM":
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))

    def cap(key: str) -> float | None:
        value = cfg.get(key, defaults[key])
        return float(value) if value else None

    # transformers' Gemma 3 never passes its attn_logit_softcapping to attention.
    attn_cap = cap("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None

    return {
        "rope": (theta, scaling),
        "hidden_act": act,
        "sliding_window": int(window) if window and any(sliding) else None,
        "sliding_layers": sliding if window and any(sliding) else (),
        "attn_logit_softcap": attn_cap,
        "final_logit_softcap": cap("final_logit_softcapping"),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "rope_local_theta": local_theta,
    }


# llama.cpp's fixed Gemma layouts (llama-model.cpp): every 2nd (Gemma 2) or 6th (Gemma 3)
# layer global; the 27B models (46 and 62 layers) scale queries by hidden / heads, the others
# by head_dim (HF's query_pre_attn_scalar, which GGUF does not store).
_GGUF_GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}


def _gguf_gemma(
    get: Any, arch: str, num_layers: int, hidden_per_head: int, head_dim: int
) -> dict[str, Any]:
    """ModelConfig's Gemma fields from GGUF metadata (keys as llama.cpp's converter writes)."""
    pattern, layers_27b = _GGUF_GEMMA[arch]
    stored = get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(stored, list):  # one flag per layer, true = sliding
        sliding = tuple(bool(x) for x in stored)
    else:
        pattern = int(stored or pattern)
        sliding = tuple(bool((i + 1) % pattern) for i in range(num_layers))
    window = get(f"{arch}.attention.sliding_window")
    attn_cap = get(f"{arch}.attn_logit_softcapping") if arch == "gemma2" else None
    final_cap = get(f"{arch}.final_logit_softcapping")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window and any(sliding) else None,
        "sliding_layers": sliding if window and any(sliding) else (),
        "attn_logit_softcap": float(attn_cap) if attn_cap else None,
        "final_logit_softcap": float(final_cap) if final_cap else None,
        "query_pre_attn_scalar": float(hidden_per_head if num_layers == layers_27b else head_dim),
        "rope_local_theta": (
            float(get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None
        ),
    }
