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
from services.executor.models.linear import choose_gemv
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
