"""Phi-3: LongRoPE past the original context, the engine's paths (radix cache, chunked
prefill, retraction) on it, config.json files as Microsoft publishes them, and the fused
checkpoint tensors.

The served context here (512) exceeds LongRoPE's original one (16), so our model takes the
long factors at every position. transformers takes them only once the sequence passes 16
tokens: the two agree on sequences longer than that, which is all these tests compare.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.executor.distributed.group import TPGroup
from services.executor.errors import ModelLoadError, UnsupportedModelError
from services.executor.model_config import ModelConfig
from services.executor.models.llama import LlamaForCausalLM
from services.executor.weights import load_model
from services.executor.weights.loader import hf_state_dict

from .helpers import (
    BatchDriver,
    greedy_generate,
    hf_argmax_continuation,
    hf_greedy,
    hf_last_logits,
    longrope,
    make_hf_model,
    write_tiny_model,
)
from .test_engine import Run, make_engine, make_request
from .test_engine_cache import CachedRun

SEED = 7
ORIGINAL = 16
LONG: dict[str, Any] = {
    "rope_scaling": longrope(rotary_dim=12, original=ORIGINAL),
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": ORIGINAL,
    "tie_word_embeddings": False,
}


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# All longer than the original context of 16.
PROMPTS = [prompt(1, 17), prompt(2, 30), prompt(3, 23)]


class Tiny(NamedTuple):
    path: Path
    hf: PreTrainedModel
    model: LlamaForCausalLM
    config: ModelConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = write_tiny_model(tmp_path_factory.mktemp("phi3"), "phi3", seed=SEED, **LONG)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, config = load_model(path, "cpu", torch.float32)
    return Tiny(path, hf, model, config)


def test_long_factors_past_the_original_context_match_transformers(tiny: Tiny) -> None:
    _, hf, model, config = tiny
    assert config.max_position_embeddings == 512 and config.rotary_dim == 12
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request() for _ in PROMPTS], PROMPTS)
    expected = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    ours = greedy_generate(model, config, PROMPTS, max_new_tokens=24)
    assert ours == [hf_greedy(hf, p, 24) for p in PROMPTS]


def test_long_factors_from_the_first_position(tiny: Tiny) -> None:
    """A prompt within the original context still takes the long factors, so its keys are
    the ones it would have as the prefix of a longer request: transformers' own model
    with the long factors in place of the short ones is what it matches."""
    _, hf, model, config = tiny
    short = prompt(4, 9)
    rope = {**LONG["rope_scaling"], "short_factor": LONG["rope_scaling"]["long_factor"]}
    hf_long = make_hf_model("phi3", seed=SEED, **{**LONG, "rope_scaling": rope})
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request()], [short])[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_long, short), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits, hf_last_logits(hf, short), atol=1e-2, rtol=0)


def test_chunked_prefill(tiny: Tiny) -> None:
    ps = [*PROMPTS, prompt(5, 40)]
    run = Run(make_engine(tiny.path, max_prefill_tokens=5))
    run.go({0: [make_request(f"r{i}", p, max_new=10, ignore_eos=True) for i, p in enumerate(ps)]})
    assert [run.tokens[f"r{i}"] for i in range(4)] == [
        hf_argmax_continuation(tiny.hf, p, 10) for p in ps
    ]


def test_retraction_under_memory_pressure(tiny: Tiny) -> None:
    ps = [prompt(10 + i, 17 + 3 * i) for i in range(4)]
    engine = make_engine(tiny.path, max_total_tokens=80)
    run = Run(engine)
    run.go({0: [make_request(f"r{i}", p, max_new=30, ignore_eos=True) for i, p in enumerate(ps)]})
    assert engine.policy.num_retracted > 0, "the pool was meant to force retractions"
    for i, p in enumerate(ps):
        assert run.tokens[f"r{i}"] == hf_argmax_continuation(tiny.hf, p, 30)


def test_radix_cache_reuse_across_the_original_context_is_exact(tiny: Tiny) -> None:
    """Turn 1 stays within the original context, turn 2 goes past it. Turn 1's cached keys
    were rotated with the long factors, as a fresh prefill of turn 2 rotates them, so reusing
    them gives transformers' tokens for turn 2 (which it computes with the long factors)."""
    engine = make_engine(tiny.path)
    p1 = prompt(4, 9)
    run = CachedRun(engine)
    run.go({0: [make_request("t1", p1, max_new=4, ignore_eos=True)]})
    p2 = p1 + run.tokens["t1"] + prompt(6, 10)
    assert len(p1) + 4 <= ORIGINAL < len(p2)
    run.go({0: [make_request("t2", p2, max_new=8, ignore_eos=True)]})
    assert run.cached["t2"] == len(p1) + 4 - 1
    assert run.tokens["t2"] == hf_argmax_continuation(tiny.hf, p2, 8)
    engine.policy.check_integrity()


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_each_rank_reads_its_rows_of_the_stacked_tensors(tmp_path: Path, kv_heads: int) -> None:
    """Two ranks' shards, loaded in one process (loading needs no collectives): rank r's
    qkv_proj is its q heads, then its KV head (shared by both ranks with one KV head), out
    of the checkpoint's stacked [q; k; v]; its gate_up_proj its halves of gate and of up."""
    path = write_tiny_model(tmp_path, "phi3", seed=SEED, num_key_value_heads=kv_heads)
    whole = load_file(path / "model.safetensors")
    qkv = whole["model.layers.1.self_attn.qkv_proj.weight"]
    gate, up = whole["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    q, k, v = qkv.split([64, 16 * kv_heads, 16 * kv_heads])
    for rank in (0, 1):
        model, _ = load_model(path, "cpu", torch.float32, tp=TPGroup(rank, 2))
        params = dict(model.named_parameters())
        kv = slice(16 * rank, 16 * rank + 16) if kv_heads == 2 else slice(0, 16)
        want_qkv = torch.cat([q[32 * rank : 32 * rank + 32], k[kv], v[kv]])
        assert torch.equal(params["model.layers.1.self_attn.qkv_proj.weight"], want_qkv)
        half = slice(64 * rank, 64 * rank + 64)
        want_gate_up = torch.cat([gate[half], up[half]])
        assert torch.equal(params["model.layers.1.mlp.gate_up_proj.weight"], want_gate_up)


def test_state_dict_names_are_the_checkpoints(tiny: Tiny) -> None:
    """hf_state_dict stacks q/k/v and gate/up back as Phi-3's checkpoint does (views)."""
    ours = hf_state_dict(tiny.model)
    theirs = tiny.hf.state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    name = "model.layers.0.self_attn.qkv_proj.weight"
    qkv = dict(tiny.model.named_parameters())[name]
    assert ours[name].data_ptr() == qkv.data_ptr()


def test_mis_shaped_fused_weight_is_named(tiny: Tiny, tmp_path: Path) -> None:
    weights = load_file(tiny.path / "model.safetensors")
    name = "model.layers.1.mlp.gate_up_proj.weight"
    weights[name] = weights[name][:-2]
    copy = tmp_path / "bad"
    copy.mkdir()
    (copy / "config.json").write_text((tiny.path / "config.json").read_text())
    save_file(weights, copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{name} has shape .*256 rows"):
        load_model(copy)
    del weights[name]
    save_file(weights, copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"missing: {name};"):
        load_model(copy)


# --- config.json files as published (transformers 4 format) ------------------------------


def _factors(n: int, base: float) -> list[float]:
    return [base + 0.01 * i for i in range(n)]


PHI35_MINI: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": _factors(48, 1.0),
        "long_factor": _factors(48, 1.5),
    },
    "sliding_window": 262144,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 32000,
    "torch_dtype": "bfloat16",
}
PHI4_MINI: dict[str, Any] = {
    **PHI35_MINI,
    "vocab_size": 200064,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": _factors(48, 1.0),
        "long_factor": _factors(48, 1.5),
    },
    "tie_word_embeddings": True,
    "eos_token_id": 199999,
}
PHI3_MINI_4K: dict[str, Any] = {
    **PHI35_MINI,
    "max_position_embeddings": 4096,
    "rope_scaling": None,
    "sliding_window": 2047,
}


def _config(tmp_path: Path, raw: dict[str, Any]) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf_dir(tmp_path)


def test_phi35_mini_config(tmp_path: Path) -> None:
    config = _config(tmp_path, PHI35_MINI)
    assert (config.head_dim, config.rotary_dim) == (96, 96)
    assert config.max_position_embeddings == 131072  # its window (262144) is wider
    assert config.rope_scaling == {
        "rope_type": "longrope",
        "short_factor": _factors(48, 1.0),
        "long_factor": _factors(48, 1.5),
        "original_max_position_embeddings": 4096,
        "attention_factor": pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096))),
    }


def test_phi4_mini_partial_rotary(tmp_path: Path) -> None:
    config = _config(tmp_path, PHI4_MINI)
    assert (config.head_dim, config.rotary_dim) == (128, 96)
    assert config.tie_word_embeddings and config.num_kv_heads == 8


def test_phi3_mini_4k_window_is_a_mask_over_the_whole_context(tmp_path: Path) -> None:
    config = _config(tmp_path, PHI3_MINI_4K)
    assert config.max_position_embeddings == 4096 and config.rope_scaling is None
    assert config.sliding_window == 2047
    assert all(config.layer_window(i) == 2047 for i in range(config.num_layers))


def test_su_is_longrope_and_an_explicit_attention_factor_wins(tmp_path: Path) -> None:
    rope = {**PHI35_MINI["rope_scaling"], "type": "su", "attention_factor": 1.5}
    config = _config(tmp_path, {**PHI35_MINI, "rope_scaling": rope})
    assert config.rope_scaling is not None
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["attention_factor"] == 1.5


def test_factor_count_must_match_the_rotary_dims(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"short_factor has 48 entries; .* need 64"):
        _config(tmp_path, {**PHI4_MINI, "partial_rotary_factor": 1.0})


def test_unsupported_architecture_lists_phi3(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'PhiForCausalLM'") as err:
        _config(tmp_path, {**PHI35_MINI, "architectures": ["PhiForCausalLM"]})
    assert "Phi3ForCausalLM" in str(err.value)
