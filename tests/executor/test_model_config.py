"""ModelConfig.from_hf_dir over the config.json variants seen in the wild."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.executor.errors import UnsupportedModelError
from services.executor.model_config import ModelConfig

from .helpers import LLAMA3_ROPE, write_tiny_model

LLAMA_V4: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128009],
    "torch_dtype": "bfloat16",
}


def _write(path: Path, config: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_transformers_v4_llama3_config(tmp_path: Path) -> None:
    config = ModelConfig.from_hf_dir(_write(tmp_path, LLAMA_V4, {"eos_token_id": [128008, 128009]}))
    assert config.head_dim == 128 and config.num_kv_heads == 8
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.eos_token_ids == (128001, 128009, 128008)
    assert config.torch_dtype == "bfloat16"
    assert not config.tie_word_embeddings and not config.attention_bias and not config.qk_norm


def test_transformers_v5_rope_parameters(tmp_path: Path) -> None:
    config = ModelConfig.from_hf_dir(write_tiny_model(tmp_path, "llama", rope_scaling=LLAMA3_ROPE))
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 64
    assert config.torch_dtype == "float32"
    assert config.vocab_size == 264 and config.tie_word_embeddings


def test_qwen_flags(tmp_path: Path) -> None:
    qwen2 = ModelConfig.from_hf_dir(write_tiny_model(tmp_path, "qwen2"))
    qwen3 = ModelConfig.from_hf_dir(write_tiny_model(tmp_path, "qwen3"))
    assert (qwen2.attention_bias, qwen2.qk_norm) == (True, False)
    assert (qwen3.attention_bias, qwen3.qk_norm) == (False, True)


def test_linear_rope_and_model_type_fallback(tmp_path: Path) -> None:
    raw = {k: v for k, v in LLAMA_V4.items() if k != "architectures"}
    raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
    config = ModelConfig.from_hf_dir(_write(tmp_path, raw))
    assert config.architecture == "LlamaForCausalLM"
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_mistral_sliding_window_masks_every_layer_over_the_whole_context(tmp_path: Path) -> None:
    raw = {**LLAMA_V4, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    raw["rope_scaling"] = None
    config = ModelConfig.from_hf_dir(_write(tmp_path, raw))
    assert config.max_position_embeddings == 131072
    assert [config.layer_window(i) for i in range(config.num_layers)] == [4096] * 32
    # a window no shorter than the context is no window
    raw["sliding_window"] = 131072
    assert ModelConfig.from_hf_dir(_write(tmp_path, raw)).sliding_layers == ()


def test_unsupported_rope_type_is_named(tmp_path: Path) -> None:
    raw = {**LLAMA_V4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        ModelConfig.from_hf_dir(_write(tmp_path, raw))


# Gemma 3 4B's text config as transformers<5 wrote it (the hub's form).
GEMMA3_V4: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "torch_dtype": "bfloat16",
}


def test_gemma3_hub_config(tmp_path: Path) -> None:
    config = ModelConfig.from_hf_dir(_write(tmp_path, GEMMA3_V4))
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.max_position_embeddings == 131072  # not cut to the window
    assert config.sliding_window == 1024
    assert config.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(34))
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (None, None)
    assert config.attention_scale == 256**-0.5
    assert config.qk_norm and config.hidden_act == "gelu_pytorch_tanh"
    assert config.layer_window(0) == 1024 and config.layer_window(5) is None


def test_gemma2_defaults_and_layer_types(tmp_path: Path) -> None:
    raw = {
        **GEMMA3_V4,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "query_pre_attn_scalar": 144,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
    }
    for key in ("rope_local_base_freq", "rope_scaling", "sliding_window_pattern", "rope_theta"):
        del raw[key]
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        del raw[key]  # transformers' Gemma2Config defaults: 30 and 50
    config = ModelConfig.from_hf_dir(_write(tmp_path, raw))
    assert config.max_position_embeddings == 8192
    assert config.sliding_layers == (True, False, True, False)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert (config.rope_theta, config.rope_local_theta, config.qk_norm) == (10000.0, None, False)
    assert config.attention_scale == 144**-0.5
    raw["layer_types"] = ["full_attention"] * 3 + ["sliding_attention"]
    config = ModelConfig.from_hf_dir(_write(tmp_path, raw))
    assert config.sliding_layers == (False, False, False, True)


def test_gemma_refusals_name_the_problem(tmp_path: Path) -> None:
    bidirectional = {**GEMMA3_V4, "use_bidirectional_attention": True}
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        ModelConfig.from_hf_dir(_write(tmp_path, bidirectional))
    gelu = {**GEMMA3_V4, "hidden_activation": "gelu"}
    with pytest.raises(UnsupportedModelError, match="activation 'gelu'"):
        ModelConfig.from_hf_dir(_write(tmp_path, gelu))
    multimodal = {**GEMMA3_V4, "architectures": ["Gemma3ForConditionalGeneration"]}
    with pytest.raises(UnsupportedModelError, match=r"Gemma3ForConditionalGeneration.*Gemma2"):
        ModelConfig.from_hf_dir(_write(tmp_path, multimodal))
