"""fp8 MoE experts on the GPU: a tiny Qwen3-MoE whose experts are quantized into its FP8
release's layout (128x128 block scales; the attention projections left float by the
checkpoint's `modules_to_not_convert`, so that no activation is quantized), loaded on CUDA in
fp32, against the same model holding the experts dequantized: the grouped launches' fp8 path
(the one-token DIRECT path in decode, the sorted one in prefill) gives the same logits to fp32's
rounding and the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.executor.models.moe import FusedExperts
from services.executor.quant.fp8_checkpoint import write_fp8_checkpoint
from services.executor.weights import load_model
from tests.executor.helpers import greedy_generate, write_tiny_model
from tests.executor.test_fp8_experts import PROMPTS, SHAPE, dequantized_twin
from tests.executor.test_fp8_weights import last_logits

pytestmark = pytest.mark.gpu


def experts_only(src: Path, dst: Path) -> Path:
    """The fp8 block checkpoint of `src` with its attention projections put back in float."""
    path = write_fp8_checkpoint(src, dst, "block")
    floats = load_file(src / "model.safetensors")
    state = {
        name: (floats[name] if "self_attn" in name and name in floats else t)
        for name, t in load_file(path / "model.safetensors").items()
        if not ("self_attn" in name and name.endswith("weight_scale_inv"))
    }
    save_file(state, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "re:.*self_attn.*"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_fp8_experts_on_the_gpu_answer_as_their_dequantized_weights(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path, "qwen3_moe", seed=9, **SHAPE)
    path = experts_only(src, tmp_path / "fp8")
    model, config = load_model(path, "cuda", torch.float32, attention_backend="triton")
    assert all(e.scales() is not None for e in model.modules() if isinstance(e, FusedExperts))
    twin, _ = load_model(src, "cuda", torch.float32, attention_backend="triton")
    twin.load_state_dict(dequantized_twin(load_model(path, "cpu")[0], src).state_dict())
    for prompt in PROMPTS:
        torch.testing.assert_close(
            last_logits(model, prompt, "cuda"),
            last_logits(twin, prompt, "cuda"),
            atol=1e-4,
            rtol=1e-4,
        )
    for prompts in (PROMPTS, PROMPTS[:1]):  # decode batches of two tokens, and of one (DIRECT)
        got = greedy_generate(model, config, prompts, 8, device="cuda")
        assert got == greedy_generate(twin, config, prompts, 8, device="cuda")
