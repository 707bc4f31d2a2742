"""fp8 checkpoints of mixture-of-experts models with 128x128 block scales (Qwen3-MoE-FP8's and
DeepSeek's layout), on the CPU: a tiny random Qwen3-MoE and Qwen2-MoE quantized by the project's
own quantizer (services/executor/quant/fp8_checkpoint.py: every `*_proj`, the experts' too),
loaded, and run against the same model holding every weight dequantized in fp32 (the experts
through models/moe.py's fp8 form, the projections through their fp8 method). The CPU computes
both as dequantize-then-matmul, so logits agree to 1e-5 and greedy tokens are identical; a
scale read into the wrong expert, gate's scales on up's rows, or a shard from the wrong blocks
moves them by far more. The grouped GPU kernel's fp8 path is tested against its twin in
tests/kernels/test_fused_moe.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.fp8_weights import FP8, dequantize
from kernels.fused_moe import dequantize_experts
from services.executor.distributed.group import TPGroup
from services.executor.errors import UnsupportedQuantizationError
from services.executor.models.llama import LlamaForCausalLM
from services.executor.models.moe import FusedExperts
from services.executor.quant.fp8_checkpoint import write_fp8_checkpoint
from services.executor.weights import load_model
from tests.executor.helpers import greedy_generate, write_tiny_model
from tests.executor.test_fp8_weights import dequantized_twin as dense_twin
from tests.executor.test_fp8_weights import last_logits

PROMPTS = [[11, 12, 13, 14, 15, 16], [30, 31, 40]]
# q, k and v of 128 rows each (whole blocks for the stacked parts, as the dense fp8 tests);
# hidden 192 leaves a partial last block; an expert's 160 rows a partial block row of gate's
# and one of up's, each with its own scales
SHAPE: dict[str, Any] = {"hidden_size": 192, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "head_dim": 32, "moe_intermediate_size": 160}  # fmt: skip

TP_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 8}  # q, k, v: 128 rows a rank at tp 2


def experts_of(model: LlamaForCausalLM) -> list[FusedExperts]:
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def dequantized_twin(model: LlamaForCausalLM, float_dir: Path) -> LlamaForCausalLM:
    """The dense fp8 tests' twin (every projection dequantized), its experts dequantized too."""
    twin = dense_twin(model, float_dir)
    mods = dict(twin.named_modules())
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, FusedExperts):
                s13, s2 = m.scales() or (None, None)
                assert s13 is not None and s2 is not None, name
                mods[name].w13_weight.copy_(dequantize_experts(m.w13_weight, s13, m.inter))
                mods[name].w2_weight.copy_(dequantize_experts(m.w2_weight, s2))
    return twin


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_checkpoint_matches_its_dequantized_weights(tmp_path: Path, arch: str) -> None:
    # Qwen2-MoE's shared expert: a fused gate_up of whole blocks
    extra: dict[str, Any] = {
        "qwen2_moe": {"shared_expert_intermediate_size": 128},
        "mixtral": {"intermediate_size": 160},  # its experts' width (w1, w3 in its checkpoints)
    }.get(arch, {})
    src = write_tiny_model(tmp_path, arch, seed=4, **SHAPE, **extra)
    model, config = load_model(write_fp8_checkpoint(src, tmp_path / "fp8", "block"), "cpu")
    experts = experts_of(model)
    assert len(experts) == config.num_layers
    for e in experts:
        assert e.w13_weight.dtype == FP8 and e.w2_weight.dtype == FP8
        s13, s2 = e.scales() or (None, None)
        assert s13 is not None and s2 is not None
        assert s13.shape == (e.num_experts, 4, 2) and s2.shape == (e.num_experts, 2, 2)
    twin = dequantized_twin(model, src)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            last_logits(model, prompt), last_logits(twin, prompt), atol=1e-5, rtol=1e-5
        )
    assert greedy_generate(model, config, PROMPTS, 8) == greedy_generate(twin, config, PROMPTS, 8)
    # each expert's weights are the float checkpoint's, rounded to e4m3 (gate's and up's
    # scales on their own rows: swapping them would miss by far more than fp8's rounding)
    from safetensors.torch import load_file

    state = load_file(src / "model.safetensors")
    if arch == "mixtral":
        return  # its checkpoint names differ; the logits above cover its experts
    e = experts[1]
    for j, part in enumerate(("gate", "up")):
        w = state[f"model.layers.1.mlp.experts.5.{part}_proj.weight"].float()
        w13 = dequantize_experts(e.w13_weight, e.w13_weight_scale, e.inter)
        got = w13[5, 160 * j : 160 * (j + 1)]
        assert (got - w).norm() < 0.035 * w.norm(), part
    down = state["model.layers.1.mlp.experts.5.down_proj.weight"].float()
    got_down = dequantize(e.w2_weight[5], e.w2_weight_scale[5], 128)
    assert (got_down - down).norm() < 0.035 * down.norm()


def dequantized_experts(e: FusedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    scales = e.scales()
    assert scales is not None
    return (dequantize_experts(e.w13_weight, scales[0], e.inter),
            dequantize_experts(e.w2_weight, scales[1]))  # fmt: skip


@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_each_rank_reads_its_slice_of_the_experts(tmp_path: Path, scheme: str) -> None:
    """tp 2 with 256 intermediate rows: each rank's 128 rows are one whole block of gate's,
    of up's and of down's columns (or their rows' scales, down's whole); its dequantized
    experts are the one-rank model's slices."""
    shape = {**SHAPE, **TP_HEADS, "moe_intermediate_size": 256}
    src = write_tiny_model(tmp_path, "qwen3_moe", seed=6, **shape)
    path = write_fp8_checkpoint(src, tmp_path / "fp8", scheme)
    w13, w2 = dequantized_experts(experts_of(load_model(path, "cpu")[0])[0])
    for rank in (0, 1):
        model, _ = load_model(path, "cpu", tp=TPGroup(rank, 2))
        got13, got2 = dequantized_experts(experts_of(model)[0])
        rows = slice(128 * rank, 128 * (rank + 1))
        want13 = torch.cat([w13[:, :256][:, rows], w13[:, 256:][:, rows]], 1)
        torch.testing.assert_close(got13, want13)
        torch.testing.assert_close(got2, w2[:, :, rows])


def test_a_rank_slice_inside_a_block_is_refused(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path, "qwen3_moe", seed=6, **{**SHAPE, **TP_HEADS})  # 80 rows a rank
    path = write_fp8_checkpoint(src, tmp_path / "fp8", "block")
    with pytest.raises(UnsupportedQuantizationError, match=r"whole 128-row scale blocks at tp 2"):
        load_model(path, "cpu", tp=TPGroup(0, 2))


def test_dummy_fp8_experts_are_valid_blocks(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path, "qwen3_moe", seed=7, **SHAPE)
    model, config = load_model(write_fp8_checkpoint(src, tmp_path / "fp8", "block"), "cpu",
                               load_format="dummy")  # fmt: skip
    e = experts_of(model)[0]
    w = dequantize_experts(e.w13_weight, e.w13_weight_scale, e.inter)
    assert torch.isfinite(w).all() and 0.01 < w.std().item() < 0.03  # N(0, 0.02), quantized
    assert len(greedy_generate(model, config, PROMPTS[:1], 4)[0]) == 4


def test_other_quantized_experts_are_refused(tmp_path: Path) -> None:
    """Per-tensor fp8 on an MoE model: refused at start, naming what is supported, never a
    weight-name mismatch."""
    src = write_tiny_model(tmp_path, "qwen3_moe", seed=8, **SHAPE)
    path = write_fp8_checkpoint(src, tmp_path / "t", "tensor")
    with pytest.raises(UnsupportedQuantizationError, match=r"routed experts \(MoE\).*128x128"):
        load_model(path, "cpu")


@pytest.mark.parametrize("how", ["channel", "online"])
def test_per_channel_experts_match_their_dequantized_weights(tmp_path: Path, how: str) -> None:
    """compressed-tensors' per-channel fp8 ([rows, 1] scales, gate's and up's rows apart),
    and --quantization fp8 on the float checkpoint, each expert row quantized as it loads
    (its largest |w| exactly representable: the scale is that over 448)."""
    src = write_tiny_model(tmp_path, "qwen3_moe", seed=11, **SHAPE)
    if how == "online":
        model, config = load_model(src, "cpu", quantization="fp8")
    else:
        model, config = load_model(write_fp8_checkpoint(src, tmp_path / "c", "channel"), "cpu")
    e = experts_of(model)[1]
    assert e.fp8_scheme == "channel" and e.w13_weight.dtype == FP8
    scales = e.scales()
    assert scales is not None and scales[0].shape == (e.num_experts, 2 * e.inter)
    from safetensors.torch import load_file

    down = load_file(src / "model.safetensors")["model.layers.1.mlp.experts.3.down_proj.weight"]
    torch.testing.assert_close(scales[1][3], down.float().abs().amax(dim=1) / 448)
    twin = dequantized_twin(model, src)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            last_logits(model, prompt), last_logits(twin, prompt), atol=1e-5, rtol=1e-5
        )
    assert greedy_generate(model, config, PROMPTS, 8) == greedy_generate(twin, config, PROMPTS, 8)


def test_dummy_per_channel_experts_are_valid(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path, "qwen3_moe", seed=12, **SHAPE)
    model, _ = load_model(src, "cpu", quantization="fp8", load_format="dummy")
    e = experts_of(model)[0]
    scales = e.scales()
    assert scales is not None
    w = dequantize_experts(e.w2_weight, scales[1])
    assert torch.isfinite(w).all() and 0.01 < w.std().item() < 0.03


@pytest.mark.parametrize(
    ("arch", "how"), [("deepseek_v2", "block"), ("deepseek_v3", "block"), ("deepseek_v2", "online")]
)
def test_deepseek_checkpoint_matches_its_dequantized_weights(
    tmp_path: Path, arch: str, how: str
) -> None:
    """DeepSeek's FP8 release's layout: latent attention's projections, the dense layers'
    MLP, the shared and routed experts in e4m3 with block scales. kv_b_proj, whose halves
    are absorbed as matrices, is dequantized after loading; the others stay fp8."""
    from services.executor.models.deepseek import MLAttention
    from services.executor.models.linear import UNQUANTIZED

    # fused gate/up (dense and shared MLPs) of whole 128-row blocks; routing as test_models'
    shape: dict[str, Any] = {"intermediate_size": 128, "moe_intermediate_size": 128,
                             "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 2,
                             "topk_group": 1}  # fmt: skip
    if arch == "deepseek_v3":
        shape["q_lora_rank"] = 24  # q_a_proj and q_b_proj, both fp8
    else:
        shape["topk_method"] = "group_limited_greedy"
    src = write_tiny_model(tmp_path, arch, seed=10, **shape)
    if how == "online":  # --quantization fp8 on the float checkpoint: per channel at load
        model, config = load_model(src, "cpu", quantization="fp8")
    else:
        model, config = load_model(write_fp8_checkpoint(src, tmp_path / "fp8", "block"), "cpu")
    attn = model.get_submodule("model.layers.0.self_attn")
    assert isinstance(attn, MLAttention)
    assert attn.kv_b_proj.method is UNQUANTIZED and attn.kv_b_proj.weight.dtype == torch.float32
    assert not hasattr(attn.kv_b_proj, "weight_scale_inv")
    assert not hasattr(attn.kv_b_proj, "weight_scale")
    assert attn.o_proj.weight.dtype == FP8 and attn.kv_a_proj_with_mqa.weight.dtype == FP8
    first, _ = attn._input_projections()
    assert first.weight.dtype == FP8 and attn.input_proj is None  # not fused with kv_a
    assert experts_of(model) and all(e.scales() is not None for e in experts_of(model))
    twin = dequantized_twin(model, src)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            last_logits(model, prompt), last_logits(twin, prompt), atol=1e-5, rtol=1e-5
        )
    assert greedy_generate(model, config, PROMPTS, 8) == greedy_generate(twin, config, PROMPTS, 8)


def test_an_ignore_list_in_the_checkpoints_own_expert_names_keeps_them_float(
    tmp_path: Path,
) -> None:
    """Mixtral's experts are w1/w2/w3 in its checkpoints: an ignore list naming layer 0's by
    those names leaves that layer's experts in the model dtype (loading its float tensors),
    the other layer's fp8."""
    import json

    from safetensors.torch import load_file, save_file

    src = write_tiny_model(tmp_path, "mixtral", seed=13, **SHAPE, intermediate_size=160)
    path = write_fp8_checkpoint(src, tmp_path / "c", "channel")
    floats = load_file(src / "model.safetensors")
    layer0 = "model.layers.0.block_sparse_moe.experts."
    state = {  # layer 0's experts back in float, without their scales
        n: t for n, t in load_file(path / "model.safetensors").items() if not n.startswith(layer0)
    }
    state.update({n: t for n, t in floats.items() if n.startswith(layer0)})
    save_file(state, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"] = [
        "lm_head",
        r"re:.*layers\.0\.block_sparse_moe\.experts\.\d+\.w[123]$",
    ]
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(path, "cpu")
    first, second = experts_of(model)
    assert first.scales() is None and first.w13_weight.dtype == torch.float32
    assert second.scales() is not None and second.w13_weight.dtype == FP8
