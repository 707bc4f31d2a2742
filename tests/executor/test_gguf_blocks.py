"""GGUF projections kept as their blocks (quant/gguf_config.py, gguf_linear.py), on the CPU:
a tiny Llama written with a Q4_K_M-like mix of types per tensor, loaded with
`gguf_blocks=True`, against the same file dequantised at load.

On the CPU a block projection dequantises per call with dequantize_ref, bit-exact with the
gguf package the dequantised load uses, so logits agree to 1e-5 and greedy tokens are the
same; a block read from the wrong rows (un-permuted Q/K, a stacked part, a TP slice cut in
the wrong bytes) moves them by far more. The kernels the GPU runs instead are tested, on a
loaded model too, in tests/kernels/test_gguf_linear.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from kernels.fp8_weights import FP8
from services.executor.distributed.group import TPGroup
from services.executor.models.linear import Linear
from services.executor.models.llama import LlamaForCausalLM
from services.executor.weights import load_model
from tests.executor.helpers import BatchDriver, greedy_generate, make_hf_model, write_tiny_model
from tests.executor.tiny_gguf import write_tiny_gguf

Q8_0, Q4_K, Q6_K = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
# K-quant rows are whole 256-weight super-blocks: hidden 256, intermediate 512
SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
# The rest Q8_0 (embedding and tied LM head included). Layer 0's q, k, v differ in type (its
# qkv_proj is dequantised); layer 1's o_proj is Q4_K, which a 2-way row split cuts mid block.
TYPES = {
    "attn_q": Q4_K,
    "attn_k": Q4_K,
    "attn_v": Q6_K,
    "blk.1.attn_v": Q4_K,
    "blk.1.attn_output": Q4_K,
    "ffn_gate": Q4_K,
    "ffn_up": Q4_K,
    "ffn_down": Q6_K,
}
# the method of each projection (None: dequantised at load)
METHODS = {
    "model.layers.0.self_attn.qkv_proj": None,
    "model.layers.0.self_attn.o_proj": "gguf-Q8_0",
    "model.layers.0.mlp.gate_up_proj": "gguf-Q4_K",
    "model.layers.0.mlp.down_proj": "gguf-Q6_K",
    "model.layers.1.self_attn.qkv_proj": "gguf-Q4_K",
    "model.layers.1.self_attn.o_proj": "gguf-Q4_K",
    "model.layers.1.mlp.gate_up_proj": "gguf-Q4_K",
    "model.layers.1.mlp.down_proj": "gguf-Q6_K",
    "lm_head": None,
}
PROMPTS = [[11, 12, 13, 14, 15, 16], [30, 31, 40]]


def write_mixed_gguf(path: Path) -> Path:
    write_tiny_gguf(path, make_hf_model("llama", seed=4, **SHAPE), "llama", Q8_0, types=TYPES)
    return path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixed_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf")


def linears(model: LlamaForCausalLM) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def methods(model: LlamaForCausalLM) -> dict[str, str | None]:
    return {
        n: (m.weight.dtype == torch.uint8 and m.method.name) or None
        for n, m in linears(model).items()
    }


def last_logits(model: LlamaForCausalLM) -> torch.Tensor:
    driver = BatchDriver(model, model.config)
    return driver.extend([driver.new_request() for _ in PROMPTS], PROMPTS)


def test_blocks_stay_blocks_and_match_the_dequantised_load(gguf_path: Path) -> None:
    model, config = load_model(gguf_path, "cpu", torch.float32, gguf_blocks=True)
    assert methods(model) == METHODS
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.float32
    # 144 bytes per 256 Q4_K weights: layer 1's qkv is [512 rows, 1 super-block]
    assert linears(model)["model.layers.1.self_attn.qkv_proj"].weight.shape == (512, 144)
    assert linears(model)["model.layers.0.mlp.down_proj"].weight.shape == (256, 2 * 210)
    dense, _ = load_model(gguf_path, "cpu", torch.float32)  # the CPU's default: dequantised
    assert dense.quantization is None and all(v is None for v in methods(dense).values())
    torch.testing.assert_close(last_logits(model), last_logits(dense), atol=1e-5, rtol=1e-5)
    assert greedy_generate(model, config, PROMPTS, 8) == greedy_generate(dense, config, PROMPTS, 8)


def test_each_rank_holds_its_rows_and_whole_blocks_of_columns(gguf_path: Path) -> None:
    """TP=2: column-parallel projections hold their rows of blocks (their q/k/v heads, gate
    and up rows); row-parallel ones their whole blocks of columns, or, where a slice would
    cut a Q4_K super-block (layer 1's o_proj, 128 of 256 columns), the dequantised weight."""
    whole, _ = load_model(gguf_path, "cpu", torch.float32, gguf_blocks=True)
    full = {n: m.method.dequantized(m) for n, m in linears(whole).items()}
    for rank in (0, 1):
        model, _ = load_model(
            gguf_path, "cpu", torch.float32, tp=TPGroup(rank, 2), gguf_blocks=True
        )
        got = methods(model)
        assert got == {**METHODS, "model.layers.1.self_attn.o_proj": None}
        deq = {n: m.method.dequantized(m) for n, m in linears(model).items()}
        q, kv, inter = 256, 128, 512
        for layer in (0, 1):
            qkv = full[f"model.layers.{layer}.self_attn.qkv_proj"].split([q, kv, kv])
            want = torch.cat([p[rank * len(p) // 2 : (rank + 1) * len(p) // 2] for p in qkv])
            torch.testing.assert_close(deq[f"model.layers.{layer}.self_attn.qkv_proj"], want)
            gate_up = full[f"model.layers.{layer}.mlp.gate_up_proj"].split(inter)
            want = torch.cat([p[rank * 256 : (rank + 1) * 256] for p in gate_up])
            torch.testing.assert_close(deq[f"model.layers.{layer}.mlp.gate_up_proj"], want)
            for name, cols in (("self_attn.o_proj", 128), ("mlp.down_proj", 256)):
                n = f"model.layers.{layer}.{name}"
                torch.testing.assert_close(deq[n], full[n][:, rank * cols : (rank + 1) * cols])


def test_quantization_fp8_dequantises_the_blocks_then_quantizes(gguf_path: Path) -> None:
    model, config = load_model(gguf_path, "cpu", quantization="fp8", gguf_blocks=True)
    assert model.quantization is not None and model.quantization.family == "fp8"
    layers = [m for n, m in linears(model).items() if n != "lm_head"]
    assert len(layers) == 4 * config.num_layers
    assert all(m.weight.dtype == FP8 for m in layers)


def test_dummy_block_weights_from_a_config_json(tmp_path: Path) -> None:
    """quant_method gguf in config.json (gpu_bench's GGUF Q4_K at Llama-8B shapes): every
    projection random valid Q4_K blocks of weights about N(0, 0.02); quant_decode's roofline
    counts them at 144 bytes per 256 weights (on the CPU: a 16-bit model on a GPU converts
    them for the int4 MMA, 160 bytes per 256, and the roofline counts those)."""
    from loadtest.gpu.quant import FORMATS, bytes_per_step

    path = write_tiny_model(tmp_path, "llama", seed=2, **SHAPE)
    float_model, c = load_model(path, "cpu", load_format="dummy")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = FORMATS["gguf_q4_k"].quantization_config
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(path, "cpu", load_format="dummy")
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    weights = c.num_layers * c.hidden_size * (q + 2 * kv + q + 3 * c.intermediate_size)
    want = bytes_per_step(float_model, torch.float32, 10) - 4 * weights + weights // 256 * 144
    assert bytes_per_step(model, torch.float32, 10) == want
    assert {v for n, v in methods(model).items() if n != "lm_head"} == {"gguf-Q4_K"}
    for layer in linears(model).values():
        if layer.weight.dtype == torch.uint8:
            w = layer.method.dequantized(layer)
            assert torch.isfinite(w).all() and 0.5 < float(w.std()) / 0.02 < 2.0
    assert torch.isfinite(last_logits(model)).all()


@pytest.mark.parametrize(("flag", "blocks"), [("blocks", True), ("dequantize", False)])
def test_the_gguf_weights_flag_reaches_the_loader(gguf_path: Path, flag: str, blocks: bool) -> None:
    """`--gguf-weights` (executor, serve and Engine share the flag): blocks kept on the CPU too,
    or dequantised at load whatever the device (the way back while a GPU path is suspect)."""
    from services.executor.builder import build_runner, settings_from_flags
    from services.executor.main import parse_args
    from shared.model_files import resolve_model

    a = parse_args(
        ["--model", str(gguf_path), "--device", "cpu", "--max-total-tokens", "256",
         "--gguf-weights", flag]
    )  # fmt: skip
    settings = settings_from_flags(a, resolve_model(a.model), "t", "s", 0)
    model = build_runner(settings).runner.model
    assert (methods(model) == METHODS) is blocks
    assert any(v is not None for v in methods(model).values()) is blocks
