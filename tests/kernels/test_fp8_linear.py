"""FP8 projections on a GPU (compute capability 8.9+): torch._scaled_mm with per-token
activation scales, the block-scale GEMM, the fp8 GEMV where choose_gemv picks it, and a tiny
fp8 model end to end against its dequantized twin. CPU runs of the same methods (dequantize,
then matmul) are tested in tests/executor/test_fp8_weights.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.fp8_act_quant import quantize_act_ref
from kernels.fp8_gemm import GEMM_MAX_M
from kernels.fp8_weights import BLOCK
from kernels.gemv import MAX_M
from services.executor.models.linear import Linear, choose_gemv
from services.executor.quant.base import LinearMethod
from services.executor.quant.fp8_linear import Fp8BlockMethod, Fp8ChannelMethod

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def fp8_layer(method: LinearMethod, k: int, n: int, bias: bool, seed: int = 0) -> Linear:
    layer = Linear(k, n, bias=bias).to(DEVICE, torch.bfloat16).requires_grad_(False)
    method.create_weights(layer)
    layer.method = method
    method.init_dummy(layer, torch.Generator(device=DEVICE).manual_seed(seed))
    if layer.bias is not None:
        layer.bias.normal_(0.0, 0.1)
    return layer


def w8a8_ref(
    layer: Linear, x: torch.Tensor, group: int, static: torch.Tensor | None
) -> torch.Tensor:
    """Activations quantized as the GEMM's are, both operands dequantized, fp32 products."""
    xq, xs = quantize_act_ref(x, group=group, static_scale=static)
    x_deq = xq.float() * xs.repeat_interleave(group or x.shape[1], dim=1)[:, : x.shape[1]]
    out = x_deq @ layer.method.dequantized(layer).T
    return out if layer.bias is None else out + layer.bias.float()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("m", [GEMM_MAX_M + 1, 64, 300])
def test_scaled_mm_with_per_token_scales(m: int, static: bool) -> None:
    layer = fp8_layer(Fp8ChannelMethod("channel", static_input=static), 4096, 1536, bias=True)
    x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
    scale = layer.get_buffer("act_scale") if static else None
    want = w8a8_ref(layer, x, 0, scale)
    torch.testing.assert_close(layer(x).float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "method", [Fp8ChannelMethod("channel"), Fp8BlockMethod()], ids=["channel", "block"]
)
@pytest.mark.parametrize("m", [MAX_M + 1, 8, GEMM_MAX_M])
def test_decode_batches_take_the_weight_only_gemm(method: LinearMethod, m: int) -> None:
    """Past the GEMV's rows and up to GEMM_MAX_M, kernels/fp8_gemm: x stays bf16."""
    layer = fp8_layer(method, 4096, 1536, bias=True)
    x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
    assert layer.bias is not None
    want = x.float() @ method.dequantized(layer).T + layer.bias.float()
    torch.testing.assert_close(layer(x).float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("m", "k", "n"), [(GEMM_MAX_M + 1, 4096, 1536), (200, 1000, 300)])
def test_block_gemm_through_the_layer(m: int, k: int, n: int) -> None:
    layer = fp8_layer(Fp8BlockMethod(), k, n, bias=False)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(
        layer(x).float(), w8a8_ref(layer, x, BLOCK, None), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize(
    "method", [Fp8ChannelMethod("online"), Fp8BlockMethod()], ids=["channel", "block"]
)
def test_choose_gemv_plans_fp8_layers_and_they_compute_the_same(method: LinearMethod) -> None:
    layers = torch.nn.Sequential(
        fp8_layer(method, 4096, 6144, False), fp8_layer(method, 14336, 4096, False, 1)
    )
    saved = choose_gemv(layers, torch.bfloat16)
    assert set(saved) == {f"6144x4096 {method.name}", f"4096x14336 {method.name}"}
    group = BLOCK if isinstance(method, Fp8BlockMethod) else 0
    for layer in layers:
        assert isinstance(layer, Linear)
        assert layer.gemv_plan, "the fp8 GEMV reads half the bytes: it should win at one row"
        for m in range(1, MAX_M + 2):
            x = torch.randn(m, layer.in_features, dtype=torch.bfloat16, device=DEVICE)
            if m in layer.gemv_plan or m > MAX_M:  # weight-only (GEMV or GEMM): x stays bf16
                want = x.float() @ method.dequantized(layer).T
            else:
                want = w8a8_ref(layer, x, group, None)
            torch.testing.assert_close(layer(x).float(), want, atol=3e-2, rtol=3e-2)


def greedy(model: torch.nn.Module, config: Any, prompt: list[int], n: int) -> list[int]:
    """n argmax tokens after `prompt`: one prefill (w8a8), then decode steps (the GEMV)."""
    from tests.executor.helpers import BatchDriver

    driver = BatchDriver(model, config, device="cuda")
    row = driver.new_request()
    out = [int(driver.extend([row], [prompt])[0].argmax())]
    while len(out) < n:
        out.append(int(driver.decode([row], [out[-1]])[0].argmax()))
    return out


def forced_logits(
    model: torch.nn.Module, config: Any, prompt: list[int], tokens: list[int]
) -> list[torch.Tensor]:
    """Logits at each position while `tokens` are fed after `prompt`: the prefill's (w8a8),
    then one decode step's (the GEMV) per token but the last."""
    from tests.executor.helpers import BatchDriver

    driver = BatchDriver(model, config, device="cuda")
    row = driver.new_request()
    out = [driver.extend([row], [prompt])[0].float()]
    out += [driver.decode([row], [t])[0].float() for t in tokens[:-1]]
    return out


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_a_tiny_fp8_model_on_the_gpu_follows_its_dequantized_twin(
    tmp_path: Path, scheme: str
) -> None:
    """Prefill runs w8a8 (activations quantized per token), decode the w8a16 GEMV: both stay
    close to the bf16 model holding the dequantized weights. Both models are fed the twin's
    greedy tokens, so every position is compared (a free-running comparison stops meaning
    anything after the first flip, and a random tiny model's logits are near-ties everywhere:
    on an H200 the first prefill token already flipped). At every position the logits agree
    to a cosine of 0.99, and the argmax agrees at three positions in four or more."""
    from services.executor.quant.fp8_checkpoint import write_fp8_checkpoint
    from services.executor.weights import load_model
    from tests.executor.helpers import write_tiny_model
    from tests.executor.test_fp8_weights import SHAPE

    src = write_tiny_model(tmp_path, "llama", seed=3, **SHAPE)
    path = write_fp8_checkpoint(src, tmp_path / scheme, scheme)
    model, config = load_model(path, DEVICE, torch.bfloat16, attention_backend="triton")
    choose_gemv(model, torch.bfloat16)
    twin, _ = load_model(src, DEVICE, torch.bfloat16, attention_backend="triton")
    layers = dict(twin.named_modules())
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, Linear):
                layers[name].weight.copy_(layer.method.dequantized(layer))
    prompts = [[11, 12, 13, 14, 15, 16], [30, 31, 40], list(range(50, 90))]
    positions = flips = 0
    for p in prompts:
        tokens = greedy(twin, config, p, 16)
        for a, b in zip(
            forced_logits(model, config, p, tokens),
            forced_logits(twin, config, p, tokens),
            strict=True,
        ):
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
            positions += 1
            flips += int(a.argmax()) != int(b.argmax())
    assert flips <= positions // 4, f"{flips} of {positions} positions flipped"
