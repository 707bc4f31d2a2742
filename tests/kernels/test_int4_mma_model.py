"""A tiny int4 model whose projections keep the MMA's shuffled words (as a bf16 model on a GPU
does), run through the kernels under Triton's interpreter (kernels/w4a16_mma's `EMULATE`
sums, its expansion for prefill past 64 rows): groups of 64, and of 32 in their own layout.
On a GPU tests/kernels/test_int4_linear.py runs the same models natively."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import services.executor.quant.int4_linear as int4_linear
from services.executor.quant.int4_linear import _packed
from services.executor.weights import load_model
from tests.executor.helpers import BatchDriver, write_tiny_model
from tests.executor.test_int4_weights import FORMATS, write_int4
from tests.kernels.test_int4_linear import int4_layers

PROMPTS = [[11, 12, 13, 14, 15, 16], list(range(50, 120))]  # 70 rows: past the MMA's 64


@pytest.mark.parametrize("group", [64, 32])
def test_a_model_on_the_shuffled_words_matches_its_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: int
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter run; on CUDA tests/kernels/test_int4_linear.py covers it")
    float_dir = write_tiny_model(tmp_path / "float", "llama", seed=3)
    ckpt = write_int4(float_dir, tmp_path / "awq", **{**FORMATS["awq"], "group_size": group})
    monkeypatch.setattr(int4_linear, "mma_layout", lambda w, dtype: True)
    monkeypatch.setattr(int4_linear, "use_kernels", lambda x: True)
    model, config = load_model(ckpt.path, "cpu", torch.bfloat16)
    layers = int4_layers(model)
    assert layers and all(
        _packed(m).qmma is not None and _packed(m).qweight is None for m in layers
    )
    twin, _ = load_model(ckpt.reference, "cpu", torch.float32)
    for prompt in PROMPTS:
        got, want = BatchDriver(model, config), BatchDriver(twin, config)
        a = got.extend([got.new_request()], [prompt])[0].float()
        b = want.extend([want.new_request()], [prompt])[0].float()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
