"""Model directories for GPU runs: Llama-3.1-8B's config (dummy weights) plus a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def llama8b_dir(root: Path) -> Path:
    """config.json of Llama-3.1-8B and a small byte-level tokenizer (ids < 300, all inside
    the real vocabulary): enough for dummy-weight serving, where text content is irrelevant."""
    from tests.executor.helpers import make_tokenizer

    path = root / "llama-3.1-8b-dummy"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_3_1_8B, indent=1))
    make_tokenizer().save_pretrained(path)
    return path


def weight_bytes(config: dict[str, Any]) -> int:
    """bf16 bytes of weights read per decode step (embedding rows excluded: one row each)."""
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    mlp = 3 * h * i
    lm_head = h * config["vocab_size"]
    return 2 * (n * (attn + mlp + 2 * h) + h + lm_head)
