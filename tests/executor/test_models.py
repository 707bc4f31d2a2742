"""Our models against transformers on the same tiny random checkpoints (safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.executor.model_config import ModelConfig
from services.executor.models.llama import LlamaForCausalLM
from services.executor.weights import load_model
from services.executor.weights.loader import hf_state_dict

from .helpers import (
    LLAMA3_ROPE,
    BatchDriver,
    greedy_generate,
    hf_greedy,
    hf_last_logits,
    write_tiny_model,
)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"tie_word_embeddings": False}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {"tie_word_embeddings": False}),
    # Windows of 8: every prompt but one is longer, and generation runs far past them.
    "gemma2-window-softcap": ("gemma2", {}),
    "gemma3-window-qknorm": ("gemma3", {"tie_word_embeddings": False}),
}
# Different lengths, so batches are ragged; the last one crosses the llama3 case's
# original context of 64 during generation.
PROMPTS = [
    [72, 101, 108, 108, 111, 44, 32],
    [7, 200, 31, 99, 150],
    list(range(40, 88)),
]


class Tiny(NamedTuple):
    path: Path
    hf: PreTrainedModel
    model: LlamaForCausalLM
    config: ModelConfig


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    arch, overrides = CASES[request.param]
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, config = load_model(path, "cpu", torch.float32)
    return Tiny(path, hf, model, config)


def test_prefill_logits_match_transformers(tiny: Tiny) -> None:
    _, hf, model, config = tiny
    driver = BatchDriver(model, config)
    rows = [driver.new_request() for _ in PROMPTS]
    logits = driver.extend(rows, PROMPTS)
    expected = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    assert logits.shape == (len(PROMPTS), config.vocab_size)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_transformers_generate(tiny: Tiny) -> None:
    _, hf, model, config = tiny
    ours = greedy_generate(model, config, PROMPTS, max_new_tokens=32)
    assert ours == [hf_greedy(hf, p, 32) for p in PROMPTS]


@pytest.mark.parametrize("cached", [1, 4])
def test_extend_after_cached_prefix_matches_full_prefill(tiny: Tiny, cached: int) -> None:
    _, _, model, config = tiny
    full_driver = BatchDriver(model, config)
    full_rows = [full_driver.new_request() for _ in PROMPTS]
    full = full_driver.extend(full_rows, PROMPTS)

    driver = BatchDriver(model, config)
    rows = [driver.new_request() for _ in PROMPTS]
    driver.extend(rows, [p[:cached] for p in PROMPTS])
    # Fresh requests and cached-prefix requests mixed in one EXTEND batch.
    extra = driver.new_request()
    logits = driver.extend([*rows, extra], [*(p[cached:] for p in PROMPTS), PROMPTS[0]])
    torch.testing.assert_close(logits[:-1], full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[-1], full[0], atol=1e-5, rtol=1e-5)


def test_freed_slots_are_reused_without_leaking_context(tiny: Tiny) -> None:
    _, _, model, config = tiny
    driver = BatchDriver(model, config, num_slots=64)
    first = driver.new_request()
    expected = driver.extend([first], [PROMPTS[1]])
    driver.free(first)
    driver.extend([driver.new_request()], [PROMPTS[0]])  # overwrites the freed slots
    again = driver.new_request()
    torch.testing.assert_close(driver.extend([again], [PROMPTS[1]]), expected)


def test_dummy_weights_have_config_shapes(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "qwen3")
    model, config = load_model(path, "cpu", torch.float32, load_format="dummy")
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(config.hidden_size))
    q_norm = params["model.layers.0.self_attn.q_norm.weight"]
    assert torch.equal(q_norm, torch.ones(config.head_dim))
    q_proj = hf_state_dict(model)["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.shape == (config.num_heads * config.head_dim, config.hidden_size)
    assert abs(q_proj.std().item() - 0.02) < 0.002
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request()], [PROMPTS[0]])
    assert logits.shape == (1, config.vocab_size)
    assert torch.isfinite(logits).all()


def test_bfloat16_model_tracks_float32(tiny: Tiny) -> None:
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, config = load_model(tiny.path, "cpu", dtype)
        assert model.lm_head.weight.dtype == dtype
        driver = BatchDriver(model, config)
        logits[dtype] = driver.extend([driver.new_request()], [PROMPTS[2]])
    assert logits[torch.bfloat16].dtype == torch.float32
    scale = logits[torch.float32].abs().max().item()
    diff = (logits[torch.bfloat16] - logits[torch.float32]).abs().max().item()
    assert diff < 0.1 * scale


def test_gemma_dummy_norms_are_the_identity(tmp_path: Path) -> None:
    """Gemma's norms scale by 1 + w: random-weight benchmarks fill them with 0, not 1."""
    path = write_tiny_model(tmp_path, "gemma3")
    model, config = load_model(path, "cpu", torch.float32, load_format="dummy")
    params = dict(model.named_parameters())
    for name in ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert not params[name].any(), name
    driver = BatchDriver(model, config)
    assert torch.isfinite(driver.extend([driver.new_request()], [PROMPTS[2]])).all()
