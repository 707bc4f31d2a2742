"""GGUF block projections through the block kernels (kernels/gguf_matmul) inside a loaded
model: the tiny mixed-type Llama of tests/executor/test_gguf_blocks.py against the same file
dequantised at load. Natively on CUDA (gpu-marked), and once under Triton's CPU interpreter
(an extend, whose 9 rows are expanded for the matmul, and a decode step of 2 rows, the GEMV).

The kernels sum in fp32 in another order than torch's matmul: logits agree to 1e-4 in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import services.executor.quant.gguf_linear as gguf_linear
from kernels.gguf_blocks import dequantize_ref
from services.executor.models.linear import Linear, choose_gemv
from services.executor.models.llama import LlamaForCausalLM
from services.executor.weights import load_model
from tests.executor.helpers import BatchDriver, greedy_generate
from tests.executor.test_gguf_blocks import METHODS, PROMPTS, methods, write_mixed_gguf


def extend_then_decode(model: LlamaForCausalLM, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    driver = BatchDriver(model, model.config, device=device)
    rows = [driver.new_request() for _ in PROMPTS]
    first = driver.extend(rows, PROMPTS)
    return first, driver.decode(rows, first.argmax(-1).tolist())


def test_the_kernels_in_a_loaded_model_match_the_dequantised_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter run; on CUDA the gpu test below covers it")
    path = write_mixed_gguf(tmp_path / "mixed.gguf")
    model, _ = load_model(path, "cpu", torch.float32, gguf_blocks=True)
    dense, _ = load_model(path, "cpu", torch.float32)
    want = extend_then_decode(dense, "cpu")
    monkeypatch.setattr(gguf_linear, "use_kernels", lambda x: True)
    got = extend_then_decode(model, "cpu")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_a_block_gguf_model_on_cuda_gives_the_dequantised_tokens(tmp_path: Path) -> None:
    path = write_mixed_gguf(tmp_path / "mixed.gguf")
    model, config = load_model(path, "cuda", torch.float32)  # blocks: CUDA's default
    assert methods(model) == METHODS
    dense, _ = load_model(path, "cuda", torch.float32, gguf_blocks=False)
    for g, w in zip(
        extend_then_decode(model, "cuda"), extend_then_decode(dense, "cuda"), strict=True
    ):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    want = greedy_generate(dense, config, PROMPTS, 16, device="cuda")
    assert greedy_generate(model, config, PROMPTS, 16, device="cuda") == want
    choose_gemv(model, torch.float32)  # the GEMV configurations where they win
    assert greedy_generate(model, config, PROMPTS, 16, device="cuda") == want


def _close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """A bf16 model's logits against the fp32 dequantised model's: within a few of bf16's
    roundings of the largest logit."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 0.05 * want.abs().max().item(), err


def _q4k_layers(model: LlamaForCausalLM) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear) and m.method.name == "gguf-Q4_K"]


def test_q4k_projections_converted_for_the_mma_in_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model whose Q4_K projections take the int4 MMA's layout (as on a GPU; here the
    kernel's interpreter sums): converted at load, blocks gone, and an extend (the expansion
    past 64 rows is not reached: 9 rows, the MMA) and a decode step close to the dequantised
    load."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter run; on CUDA the gpu test below covers it")
    path = write_mixed_gguf(tmp_path / "mixed.gguf")
    monkeypatch.setattr(gguf_linear, "q4k_mma_layout", lambda layer, dtype: True)
    monkeypatch.setattr(gguf_linear, "use_kernels", lambda x: True)
    model, _ = load_model(path, "cpu", torch.bfloat16, gguf_blocks=True)
    layers = _q4k_layers(model)
    assert len(layers) == 4  # gate_up of both layers, layer 1's qkv and o
    assert all(gguf_linear._q4k(m) is not None and m.weight.dtype == torch.int32 for m in layers)
    packed = [gguf_linear._q4k(m) for m in layers]
    for m in layers:  # a second finish leaves a converted layer as it is
        m.method.finish(m)
    assert [gguf_linear._q4k(m) for m in layers] == packed
    dense, _ = load_model(path, "cpu", torch.float32)
    for g, w in zip(
        extend_then_decode(model, "cpu"), extend_then_decode(dense, "cpu"), strict=True
    ):
        _close_in_bf16(g, w)


@pytest.mark.gpu
def test_q4k_projections_of_a_16_bit_model_run_on_the_mma(tmp_path: Path) -> None:
    """On a GPU a bf16 model's Q4_K projections are converted at load (kernels/gguf_q4k_mma.py)
    and run on the MMA: logits close to the fp32 dequantised load, before and after the
    start-up timing (whose candidates are the MMA's launches)."""
    path = write_mixed_gguf(tmp_path / "mixed.gguf")
    model, _ = load_model(path, "cuda", torch.bfloat16)
    layers = _q4k_layers(model)
    assert layers and all(gguf_linear._q4k(m) is not None for m in layers)
    assert all(c.mma for m in layers for c in m.method.gemv_candidates(m))
    dense, _ = load_model(path, "cuda", torch.float32, gguf_blocks=False)
    want = extend_then_decode(dense, "cuda")
    for g, w in zip(extend_then_decode(model, "cuda"), want, strict=True):
        _close_in_bf16(g, w)
    choose_gemv(model, torch.bfloat16)
    for g, w in zip(extend_then_decode(model, "cuda"), want, strict=True):
        _close_in_bf16(g, w)


@pytest.mark.gpu
def test_radixserve_q4k_mma_0_keeps_the_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_Q4K_MMA", "0")
    model, _ = load_model(write_mixed_gguf(tmp_path / "mixed.gguf"), "cuda", torch.bfloat16)
    layers = _q4k_layers(model)
    assert layers and all(gguf_linear._q4k(m) is None for m in layers)
    assert all(m.weight.dtype == torch.uint8 for m in layers)


@pytest.mark.parametrize(("dtype", "std", "kept"), [
    (torch.bfloat16, 0.02, torch.bfloat16),
    (torch.float16, 0.02, torch.float16),
    (torch.float16, 2000.0, torch.float32),
    (torch.bfloat16, 2000.0, torch.bfloat16),
])  # fmt: skip
def test_converted_q4k_keeps_scales_in_the_model_type_where_the_mma_takes_them(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, std: float, kept: torch.dtype
) -> None:
    """A converted Q4_K projection's scales and mins take the model's 16-bit type (the MMA then
    puts the scales inside its A fragments), except fp16 scales of 64 or more, whose -1024 s
    would overflow there: fp32 (the MMA folds those), the same weights either way."""
    monkeypatch.setattr(gguf_linear, "q4k_mma_layout", lambda layer, act_dtype: True)
    layer = Linear(512, 32)
    layer.weight = torch.nn.Parameter(torch.empty(32, 512, dtype=dtype), requires_grad=False)
    method = gguf_linear.GgufMethod("Q4_K")
    layer.method = method
    method.create_weights(layer)
    blocks = gguf_linear.dummy_blocks(32, 512, "Q4_K", torch.Generator().manual_seed(3), std)
    layer.weight.copy_(blocks)
    want = dequantize_ref(blocks, "Q4_K")
    method.finish(layer)
    packed = gguf_linear._q4k(layer)
    assert packed is not None
    assert packed.scales.dtype == packed.mins.dtype == kept
    assert (float(packed.scales.float().abs().max()) >= 64.0) == (std > 1.0)
    err = (packed.weight() - want).abs().max() / want.abs().max()
    assert err <= (2.0**-7 if kept == torch.bfloat16 else 2.0**-9)
