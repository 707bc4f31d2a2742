"""rmsnorm against its torch twin and the model's RMSNorm, with and without a residual."""

from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import rmsnorm, rmsnorm_ref
from services.executor.models.layers import RMSNorm
from tests.kernels.helpers import ALL_DTYPES, DEVICE, EXACT_CAST, INTERPRETING, poison, randn

# Sums in another order than torch's, and two roundings (normed, then times the weight): two
# ulps of the dtype.
ULPS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = ULPS[actual.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("n", "hidden"), [(1, 64), (3, 80), (8, 13), (5, 1000)])
def test_matches_reference(n: int, hidden: int, with_residual: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + hidden)
    x = randn(n, hidden, dtype=dtype, gen=gen, scale=3.0)
    w = randn(hidden, dtype=dtype, gen=gen)
    residual = randn(n, hidden, dtype=dtype, gen=gen) if with_residual else None
    out = poison(torch.empty_like(x))
    res_out = poison(torch.empty_like(x)) if with_residual else None
    got, got_res = rmsnorm(x, w, 1e-6, residual=residual, out=out, residual_out=res_out)
    want, want_res = rmsnorm_ref(x, w, 1e-6, residual=residual)
    assert got is out
    close(got, want)
    if with_residual:
        assert got_res is res_out
        torch.testing.assert_close(got_res, want_res, **EXACT_CAST[dtype])  # one rounding
    else:
        assert got_res is x


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_matches_the_model_layer(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    layer = RMSNorm(96, 1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(randn(96, dtype=dtype, gen=gen))
        x = randn(6, 96, dtype=dtype, gen=gen)
        close(rmsnorm(x, layer.weight, 1e-5)[0], layer(x))


def test_in_place_fused_add() -> None:
    """out=x and residual_out=residual, as a decoder layer calls it between sublayers."""
    gen = torch.Generator().manual_seed(2)
    x = randn(4, 128, dtype=torch.bfloat16, gen=gen)
    residual = randn(4, 128, dtype=torch.bfloat16, gen=gen)
    w = randn(128, dtype=torch.bfloat16, gen=gen)
    want, want_res = rmsnorm_ref(x, w, 1e-6, residual=residual)
    got, got_res = rmsnorm(x, w, 1e-6, residual=residual, out=x, residual_out=residual)
    assert got is x and got_res is residual
    close(x, want)
    torch.testing.assert_close(residual, want_res, **EXACT_CAST[torch.bfloat16])


def test_strided_rows_and_defaults() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = randn(5, 100, dtype=torch.float32, gen=gen)
    x = wide[:, 10:74]  # row stride 100
    w = randn(64, dtype=torch.float32, gen=gen)
    got, res = rmsnorm(x, w, 1e-6, residual=x)
    want, want_res = rmsnorm_ref(x, w, 1e-6, residual=x)
    close(got, want)
    close(res, want_res)
    assert got.is_contiguous() and res.is_contiguous()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": torch.zeros(2, 3, 4)}, ValueError, r"x must have shape \[n, hidden\]"),
        ({"weight": torch.zeros(5)}, ValueError, r"weight must have shape \[hidden\] = \(8\)"),
        ({"residual": torch.zeros(3, 8)}, ValueError, r"residual must have shape"),
        ({"residual": torch.zeros(2, 8, dtype=torch.float16)}, TypeError, r"residual must be"),
        ({"residual_out": torch.zeros(2, 8)}, ValueError, r"residual_out needs a residual"),
        ({"out": torch.zeros(2, 8, dtype=torch.float16)}, TypeError, r"out must be one of float32"),
        ({"x": torch.zeros(2, 70000)}, ValueError, r"hidden size 70000 is over"),
    ],
)
def test_rejects_bad_arguments(
    kwargs: dict[str, torch.Tensor], error: type[Exception], match: str
) -> None:
    args: dict[str, torch.Tensor] = {"x": torch.zeros(2, 8), "weight": torch.ones(8), **kwargs}
    args = {name: t.to(DEVICE) for name, t in args.items()}
    x, weight = args.pop("x"), args.pop("weight")
    with pytest.raises(error, match=match):
        rmsnorm(
            x,
            weight,
            1e-6,
            residual=args.get("residual"),
            out=args.get("out"),
            residual_out=args.get("residual_out"),
        )


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_unit_offset_matches_gemma_norm(with_residual: bool, dtype: torch.dtype) -> None:
    """Gemma's (1 + w), kept in fp32 to the one rounding: the twin and GemmaRMSNorm agree."""
    from services.executor.models.gemma import GemmaRMSNorm

    gen = torch.Generator().manual_seed(11)
    x = randn(5, 80, dtype=dtype, gen=gen, scale=3.0)
    residual = randn(5, 80, dtype=dtype, gen=gen) if with_residual else None
    layer = GemmaRMSNorm(80, 1e-6).to(device=DEVICE, dtype=dtype)
    layer.weight.data.copy_(randn(80, dtype=dtype, gen=gen, scale=0.3))
    got, got_res = rmsnorm(x, layer.weight, 1e-6, residual=residual, unit_offset=True)
    want, want_res = rmsnorm_ref(x, layer.weight, 1e-6, residual=residual, unit_offset=True)
    close(got, want)
    torch.testing.assert_close(got_res, want_res, **EXACT_CAST[dtype])
    model = layer.torch_forward(x, residual)
    model_out = model if residual is None else model[0]
    torch.testing.assert_close(want, model_out, atol=0.0, rtol=0.0)


def sequential_sum(rows: torch.Tensor) -> torch.Tensor:
    """[n, k, hidden] -> [n, hidden]: the k rows added in order in fp32, rounded once, as
    kernels/fused_moe.py's top-k sum adds them."""
    total = rows[:, 0].float()
    for j in range(1, rows.shape[1]):
        total = total + rows[:, j].float()
    return total.to(rows.dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("n", "k", "hidden"), [(1, 8, 64), (3, 6, 80), (2, 1, 13)])
def test_a_token_s_rows_are_summed_before_the_residual_add(
    n: int, k: int, hidden: int, dtype: torch.dtype
) -> None:
    """x [n, k, hidden] (a MoE layer's unsummed experts) with a residual: the norm of the
    rows' sum plus the residual, and that sum as the new residual stream."""
    gen = torch.Generator().manual_seed(n * 100 + k)
    rows = randn(n, k, hidden, dtype=dtype, gen=gen, scale=2.0)
    residual = randn(n, hidden, dtype=dtype, gen=gen)
    w = randn(hidden, dtype=dtype, gen=gen)
    got, got_res = rmsnorm(rows, w, 1e-6, residual=residual)
    want, want_res = rmsnorm(sequential_sum(rows), w, 1e-6, residual=residual)
    if INTERPRETING and dtype == torch.bfloat16:
        # the interpreter rounds the sum toward zero, torch to nearest: an ulp of the sum's
        # size apart (on a GPU, and in fp32 and fp16, the two are equal)
        ulp = 2**-7 * float(want_res.abs().amax())
        torch.testing.assert_close(got_res, want_res, atol=ulp, rtol=0.0)
    else:
        torch.testing.assert_close(got_res, want_res, **EXACT_CAST[dtype])
    close(got, want)
    close(got, rmsnorm_ref(rows, w, 1e-6, residual=residual)[0])
    assert got.shape == got_res.shape == (n, hidden)
    layer = RMSNorm(hidden, 1e-6).to(dtype=dtype)  # the CPU path (torch): the same sum
    with torch.no_grad():
        layer.weight.copy_(w.cpu())
    close(layer(rows.cpu(), residual.cpu())[0].to(DEVICE), want)


def test_summed_rows_must_be_contiguous_per_token() -> None:
    rows = torch.zeros(2, 4, 32, device=DEVICE)[:, ::2]  # k rows two apart
    with pytest.raises(ValueError, match=r"contiguous k rows"):
        residual = torch.zeros(2, 32, device=DEVICE)
        rmsnorm(rows, torch.ones(32, device=DEVICE), 1e-6, residual=residual)
