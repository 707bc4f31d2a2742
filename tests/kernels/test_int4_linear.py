"""int4 (AWQ, GPTQ) projections on a GPU: the w4a16 GEMV for the few rows of decode (the
default launch and every configuration choose_gemv may plan), the GEMM above, dequantise +
cuBLAS past GEMM_MAX_M, and tiny int4 models end to end against the CPU reference. CPU runs
of the same methods (dequantize, then matmul) are tested in
tests/executor/test_int4_weights.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.gemv import MAX_M
from kernels.w4a16_matmul import GEMM_MAX_M
from services.executor.models.linear import Linear, choose_gemv
from services.executor.quant.int4_linear import (
    INT4_CANDIDATES,
    MMA_CANDIDATES,
    MMA_TILE_ROWS,
    _packed,
)
from services.executor.weights import load_model
from tests.executor.helpers import BatchDriver, greedy_generate, write_tiny_model
from tests.executor.test_int4_weights import FORMATS, write_int4
from tests.kernels.test_fp8_linear import greedy

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("int4gpu"), "llama", seed=3)


def int4_layers(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear) and m.method.name == "w4a16"]


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "gptq-per-channel"])
def test_dense_and_every_gemv_plan_match_the_dequantized_weight(
    float_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """Each projection of a loaded model (fused qkv, act-order perms included), fp32 inputs:
    the kernels' exact fp32 products against x @ dequantized.T."""
    ckpt = write_int4(float_dir, tmp_path / fmt, **FORMATS[fmt])
    model, _ = load_model(ckpt.path, DEVICE, torch.float32)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for layer in int4_layers(model):
        w = layer.method.dequantized(layer)
        for m in (1, MAX_M, MAX_M + 1, GEMM_MAX_M + 9):
            x = torch.randn(m, layer.in_features, device=DEVICE, generator=gen)
            want = x @ w.T
            got = layer.method.dense(layer, x, None)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            if m <= MAX_M:
                for cfg in INT4_CANDIDATES:
                    torch.testing.assert_close(
                        layer.method.gemv(layer, x, cfg), want, atol=1e-4, rtol=1e-4
                    )


@pytest.mark.parametrize("fmt", ["awq", "gptq-sym", "gptq-act-order"])
def test_a_tiny_int4_model_on_the_gpu_gives_the_cpu_references_tokens(
    float_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """In fp32, prefill through the GEMM and (the 80-token prompt) dequantise + cuBLAS, and
    decode through the GEMV (as choose_gemv plans it, Triton attention) give the CPU
    reference model's greedy tokens and logits."""
    ckpt = write_int4(float_dir, tmp_path / fmt, **FORMATS[fmt])
    model, config = load_model(ckpt.path, DEVICE, torch.float32, attention_backend="triton")
    choose_gemv(model, torch.float32)
    twin, _ = load_model(ckpt.reference, "cpu", torch.float32)
    prompts = [[11, 12, 13, 14, 15, 16], [30, 31, 40], list(range(50, 130))]  # past GEMM_MAX_M
    for p in prompts:
        got = BatchDriver(model, config, device="cuda")
        want = BatchDriver(twin, config)
        a = got.extend([got.new_request()], [p])[0].float().cpu()
        b = want.extend([want.new_request()], [p])[0].float()
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    for p in prompts:
        assert greedy(model, config, p, 12) == greedy_generate(twin, config, [p], 12, ())[0]


@pytest.mark.parametrize("group", [64, 32])
@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order"])
def test_the_mma_launches_match_the_dequantized_weight(
    float_dir: Path, tmp_path: Path, fmt: str, group: int
) -> None:
    """Groups of 64, and of 32 (in their own layout), give every projection of the tiny model
    the words shuffled for kernels/w4a16_mma (in place of the plain ones); its launches (and
    the dense product up to 8 rows, which takes it) in bf16 and fp16 against x @
    dequantized.T in fp32, within the output's rounding."""
    ckpt = write_int4(float_dir, tmp_path / fmt, **{**FORMATS[fmt], "group_size": group})
    for dtype in (torch.bfloat16, torch.float16):
        model, _ = load_model(ckpt.path, DEVICE, dtype)
        layers = int4_layers(model)
        # the shuffled words in place of the plain ones: one copy of the weight on the GPU
        assert layers and all(_packed(layer).qmma is not None for layer in layers)
        assert all(_packed(layer).qweight is None for layer in layers)
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        for layer in layers:
            w = layer.method.dequantized(layer).float()
            cfgs = [c for c in layer.method.gemv_candidates(layer) if c.mma]
            assert cfgs == list(MMA_CANDIDATES)
            # compile_ahead runs the dense product at one batch of each tile count of x
            assert layer.method.dense_ahead_rows(layer) == MMA_TILE_ROWS
            for m in range(1, 9):
                x = torch.randn(m, layer.in_features, device=DEVICE, generator=gen).to(dtype)
                want = x.float() @ w.T
                tol = 2 * want.abs().max().item() * (2**-8 if dtype == torch.bfloat16 else 2**-11)
                for got in [layer.method.dense(layer, x, None)] + [
                    layer.method.gemv(layer, x, cfg) for cfg in cfgs
                ]:
                    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("group", [32, 64])
def test_a_bf16_awq_model_stays_close_to_its_reference(
    float_dir: Path, tmp_path: Path, group: int
) -> None:
    """bf16 activations (as served): logits within a cosine of 0.99 of the fp32 reference;
    greedy tokens may flip at near-ties, so most (not all) must agree. Groups of 64, and of 32
    in their own layout, decode through kernels/w4a16_mma (and prefill through its
    expansion)."""
    ckpt = write_int4(float_dir, tmp_path / "awq", **{**FORMATS["awq"], "group_size": group})
    model, config = load_model(ckpt.path, DEVICE, torch.bfloat16, attention_backend="triton")
    choose_gemv(model, torch.bfloat16)
    twin, _ = load_model(ckpt.reference, "cpu", torch.float32)
    prompts = [[11, 12, 13, 14, 15, 16], [30, 31, 40], list(range(50, 130))]  # past GEMM_MAX_M
    for p in prompts:
        got, want = BatchDriver(model, config, device="cuda"), BatchDriver(twin, config)
        a = got.extend([got.new_request()], [p])[0].float().cpu()
        b = want.extend([want.new_request()], [p])[0].float()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    ours = [greedy(model, config, p, 16) for p in prompts]
    theirs = [greedy_generate(twin, config, [p], 16, ())[0] for p in prompts]
    same = sum(
        x == y for o, t in zip(ours, theirs, strict=True) for x, y in zip(o, t, strict=False)
    )
    assert same >= 0.75 * sum(len(t) for t in theirs), (ours, theirs)
