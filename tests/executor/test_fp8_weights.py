"""FP8 checkpoints on the CPU: a tiny random Llama quantized by the project's own quantizer
(services/executor/quant/fp8_checkpoint.py) in each layout radixserve reads, loaded, and run
against the same model holding the dequantized weights in fp32.

The CPU runs an fp8 projection as dequantize-then-matmul, so the two models do the same fp32
arithmetic: logits agree to 1e-5 and greedy tokens are identical. A wrong scale, a scale
applied to the wrong rows (stacked q/k/v with their own per-tensor scales, partial 128-blocks)
or a shard read from the wrong place moves the logits by far more. Against the original
float model each dequantized weight differs by fp8's rounding only (FP8_ROUNDING); its
logits move further (two random layers amplify it), so they are not compared. The kernels
the GPU runs instead are tested in tests/kernels/test_fp8_*.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.fp8_weights import FP8
from services.executor.distributed.group import TPGroup
from services.executor.models.linear import UNQUANTIZED, Linear
from services.executor.models.llama import LlamaForCausalLM
from services.executor.quant.fp8_checkpoint import write_fp8_checkpoint
from services.executor.weights import load_model
from tests.executor.helpers import BatchDriver, greedy_generate, write_tiny_model

# q, k and v of 128 rows each (4 heads of 32, MHA): whole 128-row blocks for the stacked
# parts; hidden 192 leaves a partial last block in both dimensions (o_proj, down_proj rows;
# qkv, gate_up columns).
SHAPE: dict[str, Any] = {
    "hidden_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 256,
}
PROMPTS = [[11, 12, 13, 14, 15, 16], [30, 31, 40]]
# e4m3 keeps 3 mantissa bits: a weight rounds by at most 1/16 of itself, 2.6% in norm here
FP8_ROUNDING = 0.035


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp8"), "llama", seed=3, **SHAPE)


def dequantized_twin(model: LlamaForCausalLM, float_dir: Path) -> LlamaForCausalLM:
    """The same architecture in fp32 with every projection's weight the fp8 one, dequantized."""
    twin, _ = load_model(float_dir, "cpu", torch.float32)
    layers = dict(twin.named_modules())
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, Linear):
                layers[name].weight.copy_(layer.method.dequantized(layer))
    return twin


def last_logits(model: LlamaForCausalLM, prompt: list[int], device: str = "cpu") -> torch.Tensor:
    driver = BatchDriver(model, model.config, device=device)
    return driver.extend([driver.new_request()], [prompt])[0]


def param(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A parameter or buffer by its dotted name (a format's scales are not typed attributes)."""
    *path, leaf = name.split(".")
    t = getattr(module.get_submodule(".".join(path)), leaf)
    assert isinstance(t, torch.Tensor), name
    return t


def quantized(model: LlamaForCausalLM) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear) and m.method is not UNQUANTIZED]


@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        ("tensor", "compressed-tensors fp8 (per tensor)"),
        ("channel", "compressed-tensors fp8 (per channel)"),
        ("block", "fp8 (128x128 blocks)"),
    ],
)
def test_checkpoint_matches_its_dequantized_weights(
    float_dir: Path, tmp_path: Path, scheme: str, name: str
) -> None:
    model, config = load_model(write_fp8_checkpoint(float_dir, tmp_path / scheme, scheme), "cpu")
    assert model.quantization is not None and model.quantization.name == name
    layers = quantized(model)
    assert len(layers) == 4 * config.num_layers  # qkv, o, gate_up, down; not the LM head
    assert all(layer.weight.dtype == FP8 for layer in layers)
    assert model.lm_head.weight.dtype == torch.float32
    twin = dequantized_twin(model, float_dir)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            last_logits(model, prompt), last_logits(twin, prompt), atol=1e-5, rtol=1e-5
        )
    assert greedy_generate(model, config, PROMPTS, 8) == greedy_generate(twin, config, PROMPTS, 8)
    # the scales are the checkpoint's own: each weight is the float one, rounded
    original = dict(load_model(float_dir, "cpu", torch.float32)[0].named_modules())
    for name, layer in model.named_modules():
        if layer in layers:
            w = original[name].weight
            assert (layer.method.dequantized(layer) - w).norm() < FP8_ROUNDING * w.norm(), name


def test_per_tensor_scales_of_stacked_parts_fill_their_own_rows(
    float_dir: Path, tmp_path: Path
) -> None:
    """q, k and v each bring one scale; the fused qkv_proj holds each over its 128 rows."""
    path = write_fp8_checkpoint(float_dir, tmp_path / "t", "tensor")
    model, _ = load_model(path, "cpu")
    scale = param(model, "model.layers.0.self_attn.qkv_proj.weight_scale")[:, 0]
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    for i, part in enumerate("qkv"):
        want = state[f"model.layers.0.self_attn.{part}_proj.weight_scale"]
        assert torch.equal(scale[128 * i : 128 * (i + 1)], want.expand(128))


def test_static_input_scales_load_and_the_largest_of_a_fused_input_is_used(
    float_dir: Path, tmp_path: Path
) -> None:
    path = write_fp8_checkpoint(float_dir, tmp_path / "s", "channel", static_input=0.02)
    model, _ = load_model(path, "cpu")
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert param(model, f"{qkv}.input_scale").tolist() == pytest.approx([0.02] * 3)
    assert param(model, f"{qkv}.act_scale").tolist() == pytest.approx([0.02])


def test_quantization_fp8_quantizes_a_float_checkpoint_per_channel(float_dir: Path) -> None:
    model, config = load_model(float_dir, "cpu", quantization="fp8")
    assert model.quantization is not None and model.quantization.online
    layers = quantized(model)
    assert len(layers) == 4 * config.num_layers
    original, _ = load_model(float_dir, "cpu", torch.float32)
    w = dict(original.named_modules())["model.layers.1.mlp.down_proj"].weight
    down = model.get_submodule("model.layers.1.mlp.down_proj")
    assert isinstance(down, Linear)
    # each row's largest |w| is exactly representable: its scale is that / 448
    torch.testing.assert_close(param(down, "weight_scale")[:, 0], w.abs().amax(dim=1) / 448)
    deq = down.method.dequantized(down)
    assert ((deq - w).abs() <= w.abs() / 16 + 1e-6).all()  # e4m3: half of 2^-3 relative
    twin = dequantized_twin(model, float_dir)
    torch.testing.assert_close(
        last_logits(model, PROMPTS[0]), last_logits(twin, PROMPTS[0]), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_each_rank_holds_its_slice_of_the_quantized_weights(tmp_path: Path, scheme: str) -> None:
    """Two ranks' shards, loaded in one process: rank r's dequantized qkv (its heads), o_proj
    (its columns), gate_up and down are the matching slices of the one-rank model's."""
    shape = {**SHAPE, "num_attention_heads": 8, "num_key_value_heads": 8}  # 128 rows a rank
    src = write_tiny_model(tmp_path, "llama", seed=5, **shape)
    path = write_fp8_checkpoint(src, tmp_path / scheme, scheme)
    whole, _ = load_model(path, "cpu")
    full = {n: m.method.dequantized(m) for n, m in whole.named_modules() if isinstance(m, Linear)}
    q, i = 256, 256  # q rows (8 heads of 32) and the intermediate size
    for rank in (0, 1):
        model, _ = load_model(path, "cpu", tp=TPGroup(rank, 2))
        got = {
            n: m.method.dequantized(m) for n, m in model.named_modules() if isinstance(m, Linear)
        }
        rows = slice(128 * rank, 128 * (rank + 1))
        qkv = full["model.layers.0.self_attn.qkv_proj"].split(q)
        torch.testing.assert_close(
            got["model.layers.0.self_attn.qkv_proj"], torch.cat([part[rows] for part in qkv])
        )
        gate_up = full["model.layers.1.mlp.gate_up_proj"].split(i)
        torch.testing.assert_close(
            got["model.layers.1.mlp.gate_up_proj"], torch.cat([part[rows] for part in gate_up])
        )
        for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
            torch.testing.assert_close(got[name], full[name][:, rows])


def test_a_tensor_parallel_split_inside_a_block_is_refused(tmp_path: Path) -> None:
    from services.executor.errors import UnsupportedQuantizationError

    src = write_tiny_model(tmp_path, "llama", seed=6, **{**SHAPE, "intermediate_size": 384})
    path = write_fp8_checkpoint(src, tmp_path / "b", "block")
    with pytest.raises(UnsupportedQuantizationError, match=r"cut a 128-wide block \(--tp-size 2\)"):
        load_model(path, "cpu", tp=TPGroup(0, 2))


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_dummy_weights_are_valid_fp8(float_dir: Path, tmp_path: Path, scheme: str) -> None:
    path = write_fp8_checkpoint(float_dir, tmp_path / scheme, scheme)
    model, _ = load_model(path, "cpu", load_format="dummy")
    for layer in quantized(model):
        w = layer.method.dequantized(layer)
        assert layer.weight.dtype == FP8 and torch.isfinite(w).all()
        assert 0.05 < float(w.std()) / 0.02 < 1.5  # N(0, 0.02), quantized
    assert torch.isfinite(last_logits(model, PROMPTS[0])).all()


def test_the_engine_serves_a_float_checkpoint_with_quantization_fp8(float_dir: Path) -> None:
    """--quantization reaches the model through EngineSettings; the engine's tokens are the
    fp8 model's greedy ones."""
    from tests.executor.test_engine import make_engine

    engine = make_engine(float_dir, quantization="fp8")
    model = engine.runner.model
    assert model.quantization is not None and model.quantization.online
    want = greedy_generate(model, model.config, PROMPTS, 6, eos_ids=())
    assert engine_greedy(engine, PROMPTS, 6) == want


def engine_greedy(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The `n` greedy tokens the engine streams for each prompt (eos ignored)."""
    from tests.executor.test_engine import make_request

    for i, p in enumerate(prompts):
        engine.submit(make_request(f"r{i}", p, n, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for _, out in engine.step().outputs:
            for d in getattr(out, "deltas", []):
                tokens[d.rid] += d.token_ids
    return list(tokens.values())
