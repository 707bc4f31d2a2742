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

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# HF `model_type` -> architecture, for config.json files without an `architectures` list.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

# Families whose sliding-window layers really attend through their window (a mask over a KV
# cache that keeps every token): their context is not cut to the window.
WINDOWED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

# "freq_factors" is llama.cpp's form of llama3 scaling: per-frequency divisors in a tensor.
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "freq_factors")

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
    # --- Gemma 2/3 (defaults: what every other family does) ---
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    sliding_window: int | None = None  # a sliding layer's query at p sees keys > p - window
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends through the window; () none
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3)

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
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope scaling {rope_type!r} in {self.architecture}; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
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
        context = cfg.get("max_position_embeddings", 2048)
        # Beyond Gemma's, we only do full attention: such a model is exact up to its window.
        window = cfg.get("sliding_window")
        if (
            window
            and arch not in WINDOWED_ARCHITECTURES
            and (arch == "MistralForCausalLM" or cfg.get("use_sliding_window"))
        ):
            context = min(context, window)
        gemma = _hf_gemma(arch, cfg, path) if arch in WINDOWED_ARCHITECTURES else {}
        if gemma:
            rope_theta, rope_scaling = gemma.pop("rope")
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
            attention_bias=arch == "Qwen2ForCausalLM" or bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_id_tuple(cfg.get("eos_token_id"), gen.get("eos_token_id")),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            **gemma,
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
        head_dim = int(get(f"{a}.attention.key_length", hidden // num_heads))
        gemma: dict[str, Any] = {}
        if a in ("gemma2", "gemma3"):
            gemma = _gguf_gemma(get, a, need(f"{a}.block_count"), hidden // num_heads, head_dim)
        return cls(
            architecture=GGUF_ARCHITECTURES[a],
            # ggml shapes list the fastest-varying dimension first: [hidden, vocab].
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=need(f"{a}.feed_forward_length"),
            num_layers=need(f"{a}.block_count"),
            num_heads=num_heads,
            num_kv_heads=int(get(f"{a}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{a}.rope.freq_base", 1e6 if a == "gemma3" else 10000.0)),
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
            **gemma,
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
