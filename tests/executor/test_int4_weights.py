"""AWQ and GPTQ checkpoints on the CPU: a tiny random Llama quantized by the project's own
quantizer (services/executor/quant/int4_quantize.py) into each layout radixserve reads,
loaded through load_model, and run against the same model in fp32 holding the quantizer's
dequantized weights (its reference state dict).

The CPU runs an int4 projection as dequantize-then-matmul in fp32, so both models do the same
arithmetic: logits agree to 1e-5 and greedy tokens are identical. A nibble read in the wrong
order, a zero point off by GPTQ v1's one, a group applied to the wrong channels (act-order)
or a shard read from the wrong place moves the logits by far more. The kernels the GPU runs
instead are tested in tests/kernels/test_w4a16.py and tests/kernels/test_int4_linear.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.executor.distributed.group import TPGroup
from services.executor.errors import ModelLoadError, UnsupportedQuantizationError
from services.executor.model_config import ModelConfig
from services.executor.models.linear import Linear
from services.executor.quant.int4_linear import PackedInt4
from services.executor.quant.int4_quantize import quantize_checkpoint
from services.executor.weights import load_model
from tests.executor.helpers import greedy_generate, write_tiny_model
from tests.executor.test_fp8_weights import PROMPTS, engine_greedy, last_logits, quantized

GROUP = 32  # hidden 64: two groups per row of q/k/v/gate/up, four of down_proj
FORMATS: dict[str, dict[str, Any]] = {
    "awq": {"method": "awq", "group_size": GROUP},
    "gptq-sym": {"method": "gptq", "group_size": GROUP},
    "gptq-asym-v2": {"method": "gptq", "group_size": GROUP, "sym": False, "v2": True},
    "gptq-act-order": {"method": "gptq", "group_size": GROUP, "desc_act": True, "sym": False},
    "gptq-per-channel": {"method": "gptq", "group_size": -1},
}


class Checkpoint(NamedTuple):
    path: Path  # the int4 checkpoint
    reference: Path  # the same model, its quantized weights dequantized (float)


def write_int4(src: Path, dst: Path, **quantize: Any) -> Checkpoint:
    """`src`'s safetensors quantized by quantize_checkpoint into `dst`, and the reference
    beside it (`dst`-ref)."""
    out, q, reference = quantize_checkpoint(load_file(src / "model.safetensors"), **quantize)
    ref = dst.with_name(dst.name + "-ref")
    for d, state in ((dst, out), (ref, reference)):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(state, d / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(config))
    return Checkpoint(dst, ref)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("int4"), "llama", seed=3)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_checkpoint_matches_its_dequantized_weights(
    float_dir: Path, tmp_path: Path, fmt: str
) -> None:
    ckpt = write_int4(float_dir, tmp_path / fmt, **FORMATS[fmt])
    model, config = load_model(ckpt.path, "cpu", torch.float32)
    assert model.quantization is not None and model.quantization.family == FORMATS[fmt]["method"]
    layers = quantized(model)
    assert len(layers) == 4 * config.num_layers  # qkv, o, gate_up, down; not the LM head
    assert all(isinstance(layer.int4, PackedInt4) for layer in layers)
    assert not any(hasattr(layer, "qweight") for layer in layers)  # the checkpoint's freed
    # the plain words (no MMA on the CPU): nothing specialises by rows past the gemv's
    assert all(layer.method.dense_ahead_rows(layer) == () for layer in layers)
    assert model.lm_head.weight.dtype == torch.float32
    if FORMATS[fmt].get("desc_act"):  # scattered groups: the kernels' layout is permuted
        assert all(
            isinstance(layer.int4, PackedInt4) and layer.int4.perm is not None for layer in layers
        )
    twin, _ = load_model(ckpt.reference, "cpu", torch.float32)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            last_logits(model, prompt), last_logits(twin, prompt), atol=1e-5, rtol=1e-5
        )
    assert greedy_generate(model, config, PROMPTS, 8) == greedy_generate(twin, config, PROMPTS, 8)


def dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.method.dequantized(m) for n, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order"])
def test_each_rank_holds_its_slice_of_the_int4_weights(
    float_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """Two ranks' shards, loaded in one process: rank r's dequantized qkv (its heads), o_proj
    (its columns), gate_up and down are the matching slices of the one-rank model's. With
    act-order a row-parallel rank's channels fall in groups it shares with the other rank."""
    ckpt = write_int4(float_dir, tmp_path / fmt, **FORMATS[fmt])
    full = dequantized(load_model(ckpt.path, "cpu", torch.float32)[0])
    q, kv, inter, hidden = 64, 32, 128, 64
    for rank in (0, 1):
        model, _ = load_model(ckpt.path, "cpu", torch.float32, tp=TPGroup(rank, 2))
        got = dequantized(model)
        for layer in ("0", "1"):
            qkv = full[f"model.layers.{layer}.self_attn.qkv_proj"].split([q, kv, kv])
            want = torch.cat([p[p.shape[0] // 2 * rank :][: p.shape[0] // 2] for p in qkv])
            torch.testing.assert_close(got[f"model.layers.{layer}.self_attn.qkv_proj"], want)
            gate_up = full[f"model.layers.{layer}.mlp.gate_up_proj"].split(inter)
            want = torch.cat([p[inter // 2 * rank :][: inter // 2] for p in gate_up])
            torch.testing.assert_close(got[f"model.layers.{layer}.mlp.gate_up_proj"], want)
            for name, k in (("self_attn.o_proj", hidden), ("mlp.down_proj", inter)):
                cols = slice(k // 2 * rank, k // 2 * (rank + 1))
                torch.testing.assert_close(
                    got[f"model.layers.{layer}.{name}"],
                    full[f"model.layers.{layer}.{name}"][:, cols],
                )
        if fmt == "gptq-act-order":  # padded runs of shared groups
            o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
            assert isinstance(o_proj.int4, PackedInt4) and o_proj.int4.perm is not None
            assert bool((o_proj.int4.perm < 0).any())


def with_quantization(path: Path, q: dict[str, Any]) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = q
    (path / "config.json").write_text(json.dumps(config))
    return path


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}


@pytest.mark.parametrize(
    ("q", "named"),
    [
        ({**GPTQ, "bits": 8}, "bits=8"),
        ({**{k: v for k, v in AWQ.items() if k != "bits"}, "w_bit": 3}, "bits=3"),
        ({**AWQ, "version": "gemv"}, "version='gemv'"),
        ({**AWQ, "zero_point": False}, "zero_point=False"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format must be"),
        ({**GPTQ, "group_size": 100}, "group_size must be"),
        ({**GPTQ, "lm_head": True}, "lm_head=True"),
        ({**GPTQ, "dynamic": {"-:.*mlp.*": {}}}, "dynamic="),
    ],
)
def test_unsupported_int4_configs_are_refused_by_key(
    float_dir: Path, tmp_path: Path, q: dict[str, Any], named: str
) -> None:
    path = with_quantization(shutil.copytree(float_dir, tmp_path / "c"), q)
    with pytest.raises(UnsupportedQuantizationError, match=named) as e:
        ModelConfig.from_hf_dir(path)
    assert str(path) in str(e.value) and "supported: awq (bits 4" in str(e.value)


def test_int4_moe_models_are_refused(tmp_path: Path) -> None:
    src = with_quantization(write_tiny_model(tmp_path, "qwen2_moe", seed=2), AWQ)
    with pytest.raises(UnsupportedQuantizationError, match=r"awq int4 .* routed experts \(MoE\)"):
        load_model(src, "cpu")


def test_fused_parts_with_different_act_orders_are_refused(float_dir: Path, tmp_path: Path) -> None:
    """q, k and v read one input, so GPTQ gives them one g_idx; one layout cannot hold two."""
    ckpt = write_int4(float_dir, tmp_path / "a", **FORMATS["gptq-act-order"])
    state = load_file(ckpt.path / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, ckpt.path / "model.safetensors")
    with pytest.raises(UnsupportedQuantizationError, match="different g_idx"):
        load_model(ckpt.path, "cpu")


def test_a_float_qweight_is_refused_by_name(float_dir: Path, tmp_path: Path) -> None:
    ckpt = write_int4(float_dir, tmp_path / "a", **FORMATS["awq"])
    state = load_file(ckpt.path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.qweight"
    state[name] = state[name].float()
    save_file(state, ckpt.path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{name} is torch.float32; .* torch.int32"):
        load_model(ckpt.path, "cpu")


@pytest.mark.parametrize("q", [AWQ, {**GPTQ, "desc_act": True, "group_size": -1}])
def test_dummy_weights_are_valid_int4(float_dir: Path, tmp_path: Path, q: dict[str, Any]) -> None:
    path = with_quantization(shutil.copytree(float_dir, tmp_path / "d"), q)
    model, config = load_model(path, "cpu", load_format="dummy")
    layers = quantized(model)
    assert len(layers) == 4 * config.num_layers
    for layer in layers:
        w = layer.method.dequantized(layer)
        assert isinstance(layer.int4, PackedInt4) and torch.isfinite(w).all()
        assert 0.8 < float(w.std()) / 0.02 < 1.2
        perm = layer.int4.perm  # act-order's: an order of x's columns, as g_idx gives one
        if q.get("desc_act"):
            assert perm is not None
            assert torch.equal(
                perm.sort().values, torch.arange(layer.in_features, dtype=perm.dtype)
            )
        else:
            assert perm is None
    assert torch.isfinite(last_logits(model, PROMPTS[0])).all()


def test_the_engine_serves_an_awq_checkpoint(float_dir: Path, tmp_path: Path) -> None:
    """Through build_engine (as `radixserve serve` loads): its tokens are the int4 model's
    greedy ones, which are the reference's."""
    from tests.executor.test_engine import make_engine

    ckpt = write_int4(float_dir, tmp_path / "awq", **FORMATS["awq"])
    engine = make_engine(ckpt.path)
    model = engine.runner.model
    assert model.quantization is not None and model.quantization.family == "awq"
    twin, _ = load_model(ckpt.reference, "cpu")
    want = greedy_generate(twin, twin.config, PROMPTS, 6, eos_ids=())
    assert engine_greedy(engine, PROMPTS, 6) == want


def test_compile_ahead_reaches_every_mma_specialisation_the_graphs_use() -> None:
    """The int4 MMA specialises by its tiles of 8 rows of x (and their launch defaults) and,
    as Triton does for an integer argument, by M being 1 or a multiple of 16. Every decode
    batch size the CUDA graphs capture up to its 64 rows falls on a specialisation that the
    start-up timing (1 to 4 rows) or `dense_ahead_rows` compiles, and each of those rows
    adds one the others do not."""
    from kernels.w4a16_mma import MAX_M, mma_ahead, n_tiles
    from services.executor.cuda_graph import capture_sizes
    from services.executor.quant.int4_linear import MMA_TILE_ROWS

    def key(m: int) -> tuple[int, int, bool, bool]:
        return n_tiles(m), mma_ahead(m), m == 1, m % 16 == 0

    timed = {key(m) for m in range(1, 5)}
    ahead = [key(m) for m in MMA_TILE_ROWS]
    assert len(set(ahead)) == len(ahead) and not timed & set(ahead)
    for m in capture_sizes(512):
        if m <= MAX_M:
            assert key(m) in timed | set(ahead), m
