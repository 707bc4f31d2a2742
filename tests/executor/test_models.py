"""Our models against transformers on the same tiny random checkpoints (safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.executor.model_config import ModelConfig
from services.executor.models.llama import LlamaForCausalLM
from services.executor.models.moe import FusedExperts
from services.executor.weights import load_model
from services.executor.weights.loader import hf_state_dict

from .helpers import (
    DEEPSEEK_YARN,
    LLAMA3_ROPE,
    BatchDriver,
    greedy_generate,
    hf_greedy,
    hf_last_logits,
    longrope,
    make_hf_model,
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
    "phi3": ("phi3", {"tie_word_embeddings": False}),
    # Served context 128 = the original context: LongRoPE's short factors, as transformers
    # takes them up to 128 tokens, with the config's own attention factor; RoPE over 12 of
    # each head's 16 dims.
    "phi3-longrope-short-partial": (
        "phi3",
        {
            "rope_scaling": {**longrope(rotary_dim=12, original=128), "attention_factor": 1.2},
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 128,
            "sliding_window": None,
        },
    ),
    # Sliding windows of 8 (the prompts and generations run far past them): Mistral's on
    # every layer, Qwen2's from max_window_layers on.
    "mistral-window": ("mistral", {"sliding_window": 8, "tie_word_embeddings": False}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    # Latent attention, every layer dense: V2-Lite's plain q_proj; V3's q_lora_rank with
    # YaRN (mscale != mscale_all_dim: both corrections matter) and un-interleaved rope.
    "deepseek-v2": ("deepseek_v2", {}),
    "deepseek-v3-yarn": (
        "deepseek_v3",
        {"q_lora_rank": 24, "rope_parameters": DEEPSEEK_YARN, "rope_interleave": False},
    ),
    # DeepSeek's MoE past its first dense layer: V2's softmax router, group-limited, with a
    # shared expert; V3's sigmoid router, correction bias and grouped top-k.
    "deepseek-v2-moe": (
        "deepseek_v2",
        {
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
        },
    ),
    "deepseek-v3-moe": (
        "deepseek_v3",
        {
            "q_lora_rank": 24,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
        },
    ),
    # MoE: gated shared expert; a dense layer among sparse ones, renormalised top-3; Mixtral's
    # checkpoint names
    "qwen2-moe": ("qwen2_moe", {}),
    "qwen3-moe-mlp-only-layer": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "mixtral": ("mixtral", {"tie_word_embeddings": False}),
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


def test_dummy_moe_weights_have_config_shapes(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "qwen2_moe")
    model, config = load_model(path, "cpu", torch.float32, load_format="dummy")
    assert config.moe is not None
    moe = config.moe
    experts = model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(experts, FusedExperts)
    assert experts.w13_weight.shape == (moe.num_experts, 2 * moe.intermediate_size, 64)
    assert abs(experts.w2_weight.std().item() - 0.02) < 0.002
    state = hf_state_dict(model)
    assert state["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert state["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request()], [PROMPTS[0]])
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


def test_mixtral_state_dict_has_its_checkpoint_names(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "mixtral", tie_word_embeddings=False)
    model, _ = load_model(path, "cpu", torch.float32)
    state = hf_state_dict(model)
    saved = load_file(path / "model.safetensors")
    assert set(state) == set(saved)
    for name in ("model.layers.1.block_sparse_moe.experts.3.w3.weight", "lm_head.weight"):
        assert torch.equal(state[name], saved[name])


def test_stacked_expert_checkpoint_loads(tmp_path: Path) -> None:
    """transformers 5's in-memory layout saved as is (experts.gate_up_proj, down_proj)."""
    hf = make_hf_model("qwen3_moe", tie_word_embeddings=False)
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors")
    model, config = load_model(tmp_path, "cpu", torch.float32)
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request() for _ in PROMPTS], PROMPTS)
    expected = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_gemma_dummy_norms_are_the_identity(tmp_path: Path) -> None:
    """Gemma's norms scale by 1 + w: random-weight benchmarks fill them with 0, not 1."""
    path = write_tiny_model(tmp_path, "gemma3")
    model, config = load_model(path, "cpu", torch.float32, load_format="dummy")
    params = dict(model.named_parameters())
    for name in ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert not params[name].any(), name
    driver = BatchDriver(model, config)
    assert torch.isfinite(driver.extend([driver.new_request()], [PROMPTS[2]])).all()
