"""GGUF files written like llama.cpp's converter, loaded by us, against transformers on the
same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from services.executor.model_config import ModelConfig
from services.executor.weights import load_model
from services.executor.weights.gguf import open_gguf, unpermute_qk

from .helpers import (
    DEEPSEEK_YARN,
    EOS_ID,
    LLAMA3_ROPE,
    BatchDriver,
    greedy_generate,
    hf_greedy,
    hf_last_logits,
    longrope,
    make_hf_model,
)
from .test_models import PROMPTS
from .tiny_gguf import llama_cpp_permute, write_tiny_gguf

F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
CASES: dict[str, tuple[str, GGMLQuantizationType, dict[str, Any]]] = {
    "llama-f32": ("llama", F32, {}),
    "llama-q8_0-untied": ("llama", Q8_0, {"tie_word_embeddings": False}),
    "llama3-rope-freqs": ("llama", F32, {"rope_scaling": LLAMA3_ROPE}),
    "llama-biases": ("llama", F32, {"attention_bias": True, "mlp_bias": True}),
    "qwen2-f32-bias": ("qwen2", F32, {}),
    "qwen3-q8_0": ("qwen3", Q8_0, {}),
    "phi3-f32-untied": ("phi3", F32, {"tie_word_embeddings": False}),
    # LongRoPE's factors as rope_factors_long/short tensors (short ones taken: the context is
    # the original 128) and its attention factor, RoPE over 12 of 16 dims, a window of 16.
    "phi3-longrope-q8_0": (
        "phi3",
        Q8_0,
        {
            "rope_scaling": {**longrope(rotary_dim=12, original=128), "attention_factor": 1.2},
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 128,
            "sliding_window": 16,
        },
    ),
    "qwen2moe-f32-shared-expert": ("qwen2_moe", F32, {}),
    "qwen3moe-q8_0": ("qwen3_moe", Q8_0, {}),
    "mixtral-f32": ("mixtral", F32, {"tie_word_embeddings": False}),
    # GGUF keeps no query_pre_attn_scalar (llama.cpp scales by head_dim below 27B) and fixes
    # Gemma 3's layout at every 6th layer global.
    "gemma2-q8_0": ("gemma2", Q8_0, {"query_pre_attn_scalar": 16}),
    "gemma3-f32": (
        "gemma3",
        F32,
        {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": None},
    ),
    # 3 layers, the middle one global: a per-layer pattern and a local RoPE base in the file
    "gemma3-q8_0-layer-flags": ("gemma3", Q8_0, {"query_pre_attn_scalar": 16}),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_transformers(tmp_path: Path, case: str) -> None:
    arch, qtype, overrides = CASES[case]
    hf = make_hf_model(arch, seed=1, **overrides)
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, hf, arch, qtype)  # also rounds hf's matrices through qtype
    model, config = load_model(path, "cpu", torch.float32)

    assert config.architecture == ARCHITECTURES[arch]
    if arch.startswith("gemma"):
        hf_types = hf.config.layer_types
        assert config.sliding_layers == tuple(t == "sliding_attention" for t in hf_types)
        assert config.sliding_window == hf.config.sliding_window
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    qkv_bias = arch in ("qwen2", "qwen2_moe")
    assert config.attention_bias == (qkv_bias or overrides.get("attention_bias", False))
    if "moe" in arch or arch == "mixtral":
        assert config.moe == ModelConfig.from_hf_dir(_saved(hf, tmp_path)).moe
    assert config.eos_token_ids == (EOS_ID,)
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request() for _ in PROMPTS], PROMPTS)
    expected = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    ours = greedy_generate(model, config, PROMPTS, max_new_tokens=32)
    assert ours == [hf_greedy(hf, p, 32) for p in PROMPTS]


def _saved(hf: Any, tmp_path: Path) -> Path:
    """The HF model saved as a checkpoint directory (to read its config.json)."""
    path = tmp_path / "hf"
    hf.config.save_pretrained(path)
    return path


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(4 * 16, 3)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 4))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 4), w)
    bias = torch.arange(32, dtype=torch.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), 2)), 2), bias)


def test_gguf_config_reads_llama_cpp_metadata(tmp_path: Path) -> None:
    hf = make_hf_model("qwen3", max_position_embeddings=300, rms_norm_eps=1e-5)
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, hf, "qwen3", F32)
    config = ModelConfig.from_gguf(open_gguf(str(path)))
    assert config == ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=pytest.approx(1e-5),  # type: ignore[arg-type]
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=300,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        bos_token_id=260,
        eos_token_ids=(263,),
        torch_dtype="float32",
    )


DEEPSEEK_CASES: dict[str, tuple[str, GGMLQuantizationType, bool, dict[str, Any]]] = {
    # V2-Lite's plain attn_q, the newer converter's attn_k_b / attn_v_b, Q8_0 matrices
    "deepseek2-v2-q8_0-split": ("deepseek_v2", Q8_0, True, {}),
    # V3's attn_q_a / attn_q_b, one attn_kv_b (older converters), YaRN in the metadata
    # (llama.cpp keeps one mscale: mscale == mscale_all_dim)
    "deepseek2-v3-yarn-kv_b": (
        "deepseek_v3",
        F32,
        False,
        {"q_lora_rank": 24, "rope_parameters": {**DEEPSEEK_YARN, "mscale": 0.7}},
    ),
    # MoE past a dense first layer, one shared expert: V2's softmax router, group-limited
    # (expert_group_count 2, one used); V3's sigmoid router, correction bias (exp_probs_b),
    # grouped top-k, renormalised and scaled weights.
    "deepseek2-v2-moe-q8_0": (
        "deepseek_v2",
        Q8_0,
        True,
        {
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
        },
    ),
    "deepseek2-v3-moe": (
        "deepseek_v3",
        F32,
        True,
        {
            "q_lora_rank": 24,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
        },
    ),
}


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_deepseek2_gguf_matches_transformers(tmp_path: Path, case: str) -> None:
    arch, qtype, split, overrides = DEEPSEEK_CASES[case]
    hf = make_hf_model(arch, seed=2, **overrides)
    _randomize_correction_bias(hf)
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, hf, arch, qtype, split_kv_b=split)
    reader = open_gguf(str(path))
    assert ("blk.0.attn_k_b.weight" in {t.name for t in reader.tensors}) == split
    model, config = load_model(path, "cpu", torch.float32)
    assert config.architecture == "DeepseekV2ForCausalLM"  # V3 converts to deepseek2 too
    mla = config.mla
    assert mla is not None and mla.cache_dim == 40 and mla.rope_interleave
    assert (mla.q_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim) == (
        overrides.get("q_lora_rank"),
        12,
        16,
    )
    assert config.num_kv_heads == config.num_heads == 4 and config.head_dim == 20
    assert config.moe == ModelConfig.from_hf_dir(_saved(hf, tmp_path)).moe
    if "first_k_dense_replace" in overrides:
        assert config.moe is not None and config.moe.sparse_layers == (1,)
        assert config.moe.correction_bias == (arch == "deepseek_v3")
        assert [mla.is_moe_layer(i) for i in range(2)] == [False, True]
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request() for _ in PROMPTS], PROMPTS)
    expected = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    ours = greedy_generate(model, config, PROMPTS, max_new_tokens=16)
    assert ours == [hf_greedy(hf, p, 16) for p in PROMPTS]


def _randomize_correction_bias(hf: Any) -> None:
    """transformers keeps V3's e_score_correction_bias as a zero buffer: make it move the
    expert choice, so the file's exp_probs_b must reach the router."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)


def _deepseek2_metadata(**keys: Any) -> Any:
    """`get` over deepseek2 MoE metadata (4 experts, top-2, 3 layers, the first dense)."""
    meta = {"expert_count": 4, "expert_used_count": 2, "leading_dense_block_count": 1, **keys}
    return lambda key, default=None: meta.get(key.removeprefix("deepseek2."), default)


def _deepseek2_tensors(sparse: tuple[int, ...]) -> dict[str, Any]:
    from types import SimpleNamespace

    tensors: dict[str, Any] = {}
    for i in sparse:  # ggml shapes, fastest dimension first
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = SimpleNamespace(shape=(64, 4))
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = SimpleNamespace(shape=(64, 32, 4))
    return tensors


def test_deepseek2_moe_metadata_defaults_and_refusals() -> None:
    from services.executor.errors import UnsupportedModelError
    from services.executor.moe_config import MoEConfig

    # An early deepseek2 file: no gating function (llama.cpp: softmax), no norm, no scale.
    moe = MoEConfig.from_gguf(_deepseek2_metadata(), "deepseek2", _deepseek2_tensors((1, 2)), 3)
    assert moe == MoEConfig(
        num_experts=4,
        top_k=2,
        intermediate_size=32,
        sparse_layers=(1, 2),
        router_fp32=True,
    )
    with pytest.raises(UnsupportedModelError, match="moe_layer_freq"):  # layer 1 dense
        MoEConfig.from_gguf(_deepseek2_metadata(), "deepseek2", _deepseek2_tensors((2,)), 3)
    with pytest.raises(UnsupportedModelError, match="expert_gating_func 3"):
        get = _deepseek2_metadata(expert_gating_func=3)
        MoEConfig.from_gguf(get, "deepseek2", _deepseek2_tensors((1, 2)), 3)


def test_merge_kv_b_inverts_the_converter_split() -> None:
    from types import SimpleNamespace

    from services.executor.weights.gguf import merge_kv_b

    from .tiny_gguf import _split_kv_b

    cfg = SimpleNamespace(num_attention_heads=3, qk_nope_head_dim=5, v_head_dim=4)
    w = torch.randn(3 * 9, 7)
    k_b, v_b = _split_kv_b(w.numpy(), cfg)
    assert k_b.shape == (3, 7, 5) and v_b.shape == (3, 4, 7)
    assert torch.equal(merge_kv_b(torch.from_numpy(k_b), torch.from_numpy(v_b)), w)
