"""silu_mul and gelu_tanh_mul against their torch twins and the models' MLP arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_act import gelu_tanh_mul, gelu_tanh_mul_ref, silu_mul, silu_mul_ref
from tests.kernels.helpers import ALL_DTYPES, DEVICE, TOLERANCES, poison, randn

# exp may differ from torch's by a few fp32 ulps (approximate on a GPU), and the one rounding to
# 16 bits can then land an ulp apart.
ROUNDING = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("n", "d"), [(1, 64), (3, 13), (8, 1000), (2, 2500)])
def test_matches_reference(n: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * 10000 + d)
    gate_up = randn(n, 2 * d, dtype=dtype, gen=gen, scale=4.0)
    out = poison(torch.empty(n, d, dtype=dtype, device=DEVICE))
    assert silu_mul(gate_up, out=out) is out
    tol = ROUNDING[dtype]
    torch.testing.assert_close(out, silu_mul_ref(gate_up), atol=tol, rtol=tol)


def test_matches_the_model_mlp_in_fp32_and_strided_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = randn(4, 300, dtype=torch.float32, gen=gen)
    gate_up = wide[:, :256]  # row stride 300
    want = F.silu(gate_up[:, :128]) * gate_up[:, 128:]
    torch.testing.assert_close(silu_mul(gate_up), want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    ("gate_up", "out", "error", "match"),
    [
        (torch.zeros(2, 7), None, ValueError, r"must be even"),
        (torch.zeros(2, 3, 8), None, ValueError, r"gate_up must have shape \[n, 2 \* d\]"),
        (torch.zeros(2, 8, dtype=torch.int32), None, TypeError, r"gate_up must be one of"),
        (torch.zeros(2, 8), torch.zeros(2, 8), ValueError, r"out must have shape \[n, d\]"),
        (torch.zeros(2, 8), torch.zeros(2, 4, dtype=torch.float16), TypeError, r"out must be"),
    ],
)
def test_rejects_bad_arguments(
    gate_up: torch.Tensor, out: torch.Tensor | None, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        silu_mul(gate_up.to(DEVICE), out=None if out is None else out.to(DEVICE))


# --- gelu_tanh_mul (Gemma's gated MLP) ------------------------------------------------------
# tanh from exp here, torch's own there: a few fp32 ulps, then one rounding to 16 bits.
GELU_ROUNDING = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("n", "d"), [(1, 64), (3, 13), (2, 2500)])
def test_gelu_tanh_matches_reference(n: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * 10000 + d)
    gate_up = randn(n, 2 * d, dtype=dtype, gen=gen, scale=4.0)
    out = poison(torch.empty(n, d, dtype=dtype, device=DEVICE))
    assert gelu_tanh_mul(gate_up, out=out) is out
    tol = GELU_ROUNDING[dtype]
    torch.testing.assert_close(out, gelu_tanh_mul_ref(gate_up), atol=tol, rtol=tol)


def test_gelu_tanh_matches_the_model_mlp_in_fp32_and_strided_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = randn(4, 300, dtype=torch.float32, gen=gen, scale=6.0)
    gate_up = wide[:, :256]  # row stride 300
    want = F.gelu(gate_up[:, :128], approximate="tanh") * gate_up[:, 128:]
    torch.testing.assert_close(gelu_tanh_mul(gate_up), want, **TOLERANCES[torch.float32])


def test_gelu_tanh_rejects_an_odd_width() -> None:
    with pytest.raises(ValueError, match="must be even"):
        gelu_tanh_mul(torch.zeros(2, 7, device=DEVICE))
