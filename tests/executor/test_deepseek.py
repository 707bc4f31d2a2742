"""DeepSeek-V2/V3 (latent attention) in the engine: the config's MLA fields, MoE layers
refused, and greedy tokens equal to transformers' under continuous
batching, chunked prefill, retraction and prefix reuse (tiny all-dense models)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from services.executor.model_config import ModelConfig
from services.executor.weights import load_model
from tests.executor.helpers import (
    DEEPSEEK_YARN,
    hf_argmax_continuation,
    make_hf_model,
    write_tiny_model,
)
from tests.executor.test_engine import Run, make_engine, make_request, prompts
from tests.executor.test_engine_cache import CachedRun, prompt
from tests.executor.test_kv_cache_dtype import FP8, forced_logits

SEED = 5
V3 = {"q_lora_rank": 24, "rope_parameters": DEEPSEEK_YARN}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dsv3"), "deepseek_v3", seed=SEED, **V3)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model("deepseek_v3", seed=SEED, **V3)


def test_config_reads_the_latent_attention_fields(tiny_dir: Path) -> None:
    config = ModelConfig.from_hf_dir(tiny_dir)
    mla = config.mla
    assert mla is not None and config.architecture == "DeepseekV3ForCausalLM"
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim) == (24, 32, 12)
    assert (mla.qk_rope_head_dim, mla.v_head_dim, mla.cache_dim) == (8, 16, 40)
    assert config.head_dim == 20 and mla.rope_interleave
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    # YaRN: softmax scale times mscale(8, 0.7)^2, rotated dims times mscale(8, 0.9) / (.., 0.7)
    m07, m09 = 0.07 * math.log(8) + 1, 0.09 * math.log(8) + 1
    assert mla.softmax_scale == pytest.approx(20**-0.5 * m07**2)
    assert mla.rope_mscale == pytest.approx(m09 / m07)
    assert not any(mla.is_moe_layer(i) for i in range(config.num_layers))
    assert mla.is_moe_layer(2) and mla.is_moe_layer(3)  # first_k_dense_replace = 2


def test_moe_layers_are_the_ones_past_the_dense_ones(tmp_path: Path) -> None:
    """MLAConfig and MoEConfig read first_k_dense_replace / moe_layer_freq alike, and the
    model builds SparseMoE exactly there (models/moe.py)."""
    from services.executor.models.moe import SparseMoE

    path = write_tiny_model(tmp_path, "deepseek_v2", first_k_dense_replace=1, n_shared_experts=1)
    model, config = load_model(path, "cpu", torch.float32)
    assert config.mla is not None and config.moe is not None
    assert config.moe.sparse_layers == (1,) and config.mla.is_moe_layer(1)
    layers = list(model.model.layers)
    assert not isinstance(layers[0].mlp, SparseMoE) and isinstance(layers[1].mlp, SparseMoE)


def test_a_config_json_without_experts_is_all_dense(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "deepseek_v2")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(n_routed_experts=None, first_k_dense_replace=0, moe_layer_freq=1)
    (path / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig.from_hf_dir(path)
    assert config.mla is not None and not config.mla.is_moe_layer(1)


def test_batched_greedy_matches_transformers(tiny_dir: Path, hf_model: torch.nn.Module) -> None:
    ps = prompts(8)
    run = Run(make_engine(tiny_dir, overlap=True))
    run.go({0: [make_request(f"r{i}", p, max_new=16, ignore_eos=True) for i, p in enumerate(ps)]})
    want = [hf_argmax_continuation(hf_model, p, 16) for p in ps]
    assert [run.tokens[f"r{i}"] for i in range(8)] == want
    assert max(run.batch_sizes) > 1


@pytest.mark.parametrize("chunk", [3, 7])
def test_chunked_prefill_gives_the_same_tokens(
    tiny_dir: Path, hf_model: torch.nn.Module, chunk: int
) -> None:
    ps = prompts(4, seed=2)
    run = Run(make_engine(tiny_dir, overlap=False, max_prefill_tokens=chunk))
    run.go({0: [make_request(f"r{i}", p, max_new=8, ignore_eos=True) for i, p in enumerate(ps)]})
    assert [run.tokens[f"r{i}"] for i in range(4)] == [
        hf_argmax_continuation(hf_model, p, 8) for p in ps
    ]


def test_retraction_under_memory_pressure_keeps_outputs(
    tiny_dir: Path, hf_model: torch.nn.Module
) -> None:
    ps = prompts(6, seed=4)
    engine = make_engine(tiny_dir, overlap=True, max_total_tokens=90)
    run = Run(engine)
    run.go({0: [make_request(f"r{i}", p, max_new=40, ignore_eos=True) for i, p in enumerate(ps)]})
    assert engine.policy.num_retracted > 0, "the pool was meant to force retractions"
    for i, p in enumerate(ps):
        assert run.tokens[f"r{i}"] == hf_argmax_continuation(hf_model, p, 40)


def test_second_turn_reuses_the_first(tiny_dir: Path, hf_model: torch.nn.Module) -> None:
    engine = make_engine(tiny_dir)
    p1 = prompt(1, 20)
    run = CachedRun(engine)
    run.go({0: [make_request("t1", p1, max_new=10, ignore_eos=True)]})
    out1 = run.tokens["t1"]
    p2 = p1 + out1 + prompt(2, 7)
    run.go({0: [make_request("t2", p2, max_new=10, ignore_eos=True)]})
    assert run.cached["t2"] == len(p1) + len(out1) - 1
    assert run.tokens["t2"] == hf_argmax_continuation(hf_model, p2, 10)
    engine.policy.check_integrity()


@pytest.mark.parametrize(("name", "bound"), [("fp8_e4m3", 2.0**-4), ("fp8_e5m2", 2.0**-3)])
def test_fp8_latent_pool_stays_close_to_full_precision(
    tiny_dir: Path, name: str, bound: float
) -> None:
    """--kv-cache-dtype fp8 on the latent rows: the bound of test_kv_cache_dtype.py (the
    format's relative rounding error) along the full-precision greedy path."""
    model, config = load_model(tiny_dir, device="cpu", attention_backend="torch")
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 7, 23, 60)]
    full, path = forced_logits(model, config, ps, 12, None)
    fp8, _ = forced_logits(model, config, ps, 12, FP8[name], forced=path)
    rel = ((fp8 - full).pow(2).mean().sqrt() / full.pow(2).mean().sqrt()).item()
    assert 0 < rel <= bound, f"relative RMS logit error {rel:.4f}"


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_the_input_projections_are_one_product(tmp_path: Path, q_lora_rank: int | None) -> None:
    """After loading, q_proj (or q_a_proj) and kv_a_proj_with_mqa are views of one weight,
    multiplied once: the same outputs as the two products (and as transformers', through
    test_batched_greedy_matches_transformers), no extra memory, and only the fused product
    is timed for the decode kernel."""
    from services.executor.models.deepseek import MLAttention
    from services.executor.models.linear import planned_layers

    arch = "deepseek_v2" if q_lora_rank is None else "deepseek_v3"
    path = write_tiny_model(tmp_path, arch, q_lora_rank=q_lora_rank)
    model, _ = load_model(path, "cpu", torch.float32)
    attn = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert attn
    for layer in attn:
        first = layer.q_proj if q_lora_rank is None else layer.q_a_proj
        second = layer.kv_a_proj_with_mqa
        assert layer.input_proj is not None
        fused = layer.input_proj.weight
        assert first.weight.data_ptr() == fused.data_ptr()
        assert second.weight.data_ptr() == fused[layer.input_split :].data_ptr()
        x = torch.randn(3, fused.shape[1], generator=torch.Generator().manual_seed(2))
        got_q, got_kv = layer._project_input(x)
        torch.testing.assert_close(got_q, x @ first.weight.T, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_kv, x @ second.weight.T, atol=1e-6, rtol=1e-6)
        layer.after_loading()  # a second call changes nothing
        assert layer.input_proj.weight is fused
        # nothing calls the two views any more: choose_gemv plans the fused product only
        planned = planned_layers(model)
        assert layer.input_proj in planned
        assert first not in planned and second not in planned
