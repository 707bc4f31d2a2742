"""Tiny MoE models through the CUDA path's kernels (in the interpreter where there is no
GPU): the experts' top-k sum left to the next layer's norm (SparseMoE.defer_sum) changes no
token and no logit beyond rounding, against the same path summing it in fused_moe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kernels.rmsnorm
from services.executor.models import layers, moe
from services.executor.weights import load_model
from tests.executor.helpers import write_tiny_model
from tests.kernels.helpers import DEVICE, kernel_device
from tests.kernels.test_triton_backend import greedy_with_prefix_reuse


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_unsummed_experts_reach_the_next_norm_and_change_no_token(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_device(monkeypatch, layers, moe)
    dims: list[int] = []
    original = kernels.rmsnorm.rmsnorm

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        dims.append(x.dim())
        return original(x, *args, **kwargs)

    monkeypatch.setattr(kernels.rmsnorm, "rmsnorm", counted)
    path = write_tiny_model(tmp_path, arch)
    prompts = [[5, 9, 200, 17, 3, 88, 41], [260, 72, 101, 108], [7] * 23]
    results = []
    for defer in (False, True):
        model, config = load_model(path, device=DEVICE, attention_backend="triton")
        sparse = [m for m in model.modules() if isinstance(m, moe.SparseMoE)]
        assert sparse and all(m.defer_sum for m in sparse)  # the decoder layers ask for it
        for m in sparse:
            m.defer_sum = defer
        dims.clear()
        results.append(greedy_with_prefix_reuse(model, config, prompts, steps=1))
        assert (3 in dims) == defer  # a norm summed a layer's expert rows
    (want_tokens, want_logits), (got_tokens, got_logits) = results
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
