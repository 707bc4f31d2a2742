"""Which weight formats start and which are refused: read from config.json's
quantization_config before any weight is read (so `radixserve serve` refuses at start), the
format named in the error with the supported ones listed, never a weight-name mismatch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.executor.errors import ModelLoadError, UnsupportedQuantizationError
from services.executor.model_config import ModelConfig
from services.executor.quant.base import QuantConfig, is_ignored
from services.executor.quant.fp8_checkpoint import quantization_config, write_fp8_checkpoint
from services.executor.quant.registry import resolve
from services.executor.weights import load_model
from tests.executor.helpers import write_tiny_model

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
INT4_CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}},
}


def with_quantization(path: Path, q: dict[str, Any]) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = q
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path, "llama", seed=1)


@pytest.mark.parametrize(
    ("q", "named"),
    [
        ({**AWQ, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "gptq", "bits": 8}, "bits=8"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "mxfp4"}, "'mxfp4'"),
        ({"quant_method": "made-up"}, "'made-up'"),
        ({"bits": 4}, "'\\(none\\)'"),
        (INT4_CT, "compressed-tensors checkpoint with format 'pack-quantized'"),
        ({**quantization_config("block"), "weight_block_size": [64, 64]}, "\\[64, 64\\]"),
        ({**quantization_config("block"), "fmt": "e5m2"}, "format 'e5m2'"),
    ],
)
def test_unsupported_formats_are_refused_by_name_at_config_time(
    tiny: Path, q: dict[str, Any], named: str
) -> None:
    with_quantization(tiny, q)
    with pytest.raises(UnsupportedQuantizationError, match=named) as e:
        ModelConfig.from_hf_dir(tiny)
    assert isinstance(e.value, ModelLoadError)  # what callers that load a model catch
    assert str(tiny) in str(e.value) and "supported: " in str(e.value)


def test_the_list_of_supported_formats_is_in_the_error(tiny: Path) -> None:
    with_quantization(tiny, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(UnsupportedQuantizationError) as e:
        load_model(tiny, "cpu")
    assert "supported: fp8 (" in str(e.value) and "compressed-tensors (" in str(e.value)
    assert "awq (int4" in str(e.value) and "gptq (int4" in str(e.value)
    assert "--quantization fp8" in str(e.value)


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_the_quantizers_configs_parse_to_their_scheme(tiny: Path, scheme: str) -> None:
    config = ModelConfig.from_hf_dir(with_quantization(tiny, quantization_config(scheme)))
    q = config.quantization
    assert q is not None and q.family == "fp8" and not q.online
    assert getattr(q, "scheme", None) == scheme and q.ignore == ("lm_head",)


def test_quantization_flag_against_the_checkpoint() -> None:
    fp8 = resolve("fp8", None)
    assert fp8 is not None and fp8.online
    assert resolve("auto", None) is None
    block = QuantConfig(name="fp8 (128x128 blocks)", family="fp8")
    assert resolve("fp8", block) is block  # already fp8: the checkpoint's layout
    int4 = QuantConfig(name="awq int4", family="awq")
    with pytest.raises(UnsupportedQuantizationError, match=r"already quantized \(awq int4\)"):
        resolve("fp8", int4)
    with pytest.raises(ValueError, match="--quantization='int3': unknown"):
        resolve("int3", None)


def test_moe_models_in_other_formats_are_refused_before_loading(tmp_path: Path) -> None:
    """fp8 with one scale per tensor (the experts take blocks or a scale per channel)."""
    src = write_tiny_model(tmp_path, "qwen2_moe", seed=2)
    path = write_fp8_checkpoint(src, tmp_path / "t", "tensor")
    with pytest.raises(UnsupportedQuantizationError, match=r"routed experts \(MoE\)"):
        load_model(path, "cpu")


def test_a_fused_projection_quantized_in_part_is_refused(tiny: Path, tmp_path: Path) -> None:
    path = write_fp8_checkpoint(tiny, tmp_path / "c", "channel")
    q = quantization_config("channel")
    q["ignore"] = ["lm_head", "model.layers.0.self_attn.k_proj"]
    with pytest.raises(UnsupportedQuantizationError, match="quantizes only some of them"):
        load_model(with_quantization(path, q), "cpu")


def test_ignored_modules_stay_float_and_load_float_tensors(tiny: Path, tmp_path: Path) -> None:
    """An ignore list naming layer 1's MLP: its projections load the float tensors."""
    path = write_fp8_checkpoint(tiny, tmp_path / "c", "channel")
    q = quantization_config("channel")
    q["ignore"] = ["lm_head", "re:model\\.layers\\.1\\.mlp\\..*"]
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    float_state = load_file(tiny / "model.safetensors")
    for part in ("gate", "up", "down"):
        name = f"model.layers.1.mlp.{part}_proj"
        state[f"{name}.weight"] = float_state[f"{name}.weight"]
        del state[f"{name}.weight_scale"]
    save_file(state, path / "model.safetensors")
    model, _ = load_model(with_quantization(path, q), "cpu")
    assert model.get_parameter("model.layers.1.mlp.down_proj.weight").dtype.itemsize == 4
    assert model.get_parameter("model.layers.0.mlp.down_proj.weight").dtype.itemsize == 1


def test_a_float_weight_where_fp8_is_declared_is_refused_by_name(
    tiny: Path, tmp_path: Path
) -> None:
    path = write_fp8_checkpoint(tiny, tmp_path / "c", "channel")
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    state[name] = state[name].float()
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{name} is torch.float32; .* float8_e4m3fn"):
        load_model(path, "cpu")


@pytest.mark.parametrize(
    ("name", "patterns", "ignored"),
    [
        ("lm_head", ("lm_head",), True),
        ("model.lm_head", ("lm_head",), True),  # a dotted suffix
        ("model.layers.3.self_attn.q_proj", ("model.layers.3",), True),  # a dotted prefix
        ("model.layers.31.self_attn.q_proj", ("model.layers.3",), False),
        ("model.layers.0.mlp.gate", ("re:.*\\.mlp\\.gate$",), True),
        ("model.layers.0.mlp.gate_proj", ("re:.*\\.mlp\\.gate$",), False),
        ("model.layers.0.self_attn.q_proj", ("lm_head",), False),
    ],
)
def test_ignore_entries(name: str, patterns: tuple[str, ...], ignored: bool) -> None:
    assert is_ignored(name, patterns) == ignored


def test_the_executor_flag() -> None:
    from services.executor.main import parse_args

    assert parse_args([]).quantization == "auto"
    assert parse_args(["--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "awq"])
