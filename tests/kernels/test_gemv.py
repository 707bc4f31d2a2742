"""gemv against its torch twin: every row count, odd sizes, strided rows, and bad arguments."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.gemv import MAX_M, gemv, gemv_ref
from tests.kernels.helpers import ALL_DTYPES, DEVICE, assert_pdl_changes_no_bit, poison, randn

# fp32 sums in a different order than the reference's matmul, then one rounding to 16 bits.
ROUNDING = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
@pytest.mark.parametrize(("n", "k", "block_k"), [(8, 64, 64), (37, 100, 32), (130, 515, 128)])
def test_matches_reference(m: int, n: int, k: int, block_k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = randn(m, k, dtype=dtype, gen=gen)
    w = randn(n, k, dtype=dtype, gen=gen, scale=0.1)
    out = poison(torch.empty(m, n, dtype=dtype, device=DEVICE))
    assert gemv(x, w, out=out, block_n=8, block_k=block_k) is out
    tol = ROUNDING[dtype]
    torch.testing.assert_close(out, gemv_ref(x, w), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (4096, 4096)])
def test_llama_8b_projection_shapes(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = randn(m, k, dtype=torch.bfloat16, gen=gen)
    w = randn(n, k, dtype=torch.bfloat16, gen=gen, scale=0.02)
    torch.testing.assert_close(gemv(x, w), gemv_ref(x, w), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("m", [1, 3])
def test_every_configuration_choose_gemv_may_pick(m: int) -> None:
    """choose_gemv picks by time alone: each candidate must compute the same product, on a
    shape that leaves partial blocks in both N and K."""
    from services.executor.models.linear import CANDIDATES

    gen = torch.Generator().manual_seed(m)
    x = randn(m, 1100, dtype=torch.bfloat16, gen=gen)
    w = randn(203, 1100, dtype=torch.bfloat16, gen=gen, scale=0.05)
    want = gemv_ref(x, w)
    for cfg in CANDIDATES:
        torch.testing.assert_close(cfg(x, w), want, atol=1.6e-2, rtol=1.6e-2, msg=str(cfg))


def test_strided_rows_of_x_weight_and_out() -> None:
    gen = torch.Generator().manual_seed(7)
    x = randn(3, 80, dtype=torch.float32, gen=gen)[:, :64]  # row stride 80
    w = randn(24, 96, dtype=torch.float32, gen=gen)[:, :64]  # row stride 96
    out = poison(torch.empty(3, 40, dtype=torch.float32, device=DEVICE))[:, :24]
    gemv(x, w, out=out, block_n=8, block_k=32)
    torch.testing.assert_close(out, gemv_ref(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("x", "w", "error", "match"),
    [
        (torch.zeros(MAX_M + 1, 8), torch.zeros(4, 8), ValueError, r"1 to 4 rows"),
        (torch.zeros(1, 8), torch.zeros(4, 9), ValueError, r"weight must have shape \[n, k\]"),
        (torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.float16), TypeError, r"weight must be"),
        (torch.zeros(8), torch.zeros(4, 8), ValueError, r"x must have shape \[m, k\]"),
    ],
)
def test_rejects_bad_arguments(
    x: torch.Tensor, w: torch.Tensor, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        gemv(x.to(DEVICE), w.to(DEVICE))


@pytest.mark.gpu
def test_linear_takes_the_faster_kernel_and_computes_the_same() -> None:
    """choose_gemv times both kernels on the device; whichever each row count got, the
    projection's output is the matmul's."""
    from services.executor.models.linear import Linear, choose_gemv

    torch.manual_seed(0)
    layers = torch.nn.Sequential(Linear(4096, 6144), Linear(14336, 4096)).to(DEVICE, torch.bfloat16)
    saved = choose_gemv(layers)
    assert set(saved) == {"6144x4096", "4096x14336"}
    assert all(us >= 0 for us in saved.values())
    for layer in layers:
        assert isinstance(layer, Linear)
        for m in range(1, MAX_M + 2):
            x = torch.randn(m, layer.in_features, dtype=torch.bfloat16, device=DEVICE)
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), want, atol=3e-2, rtol=3e-2)


def test_linear_with_a_plan_runs_gemv_for_those_row_counts_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kernels.gemv
    from services.executor.models.linear import CANDIDATES, Linear

    rows: list[int] = []

    def counted(x: torch.Tensor, w: torch.Tensor, **kw: Any) -> torch.Tensor:
        rows.append(x.shape[0])
        return gemv(x, w, **kw)

    monkeypatch.setattr(kernels.gemv, "gemv", counted)
    torch.manual_seed(1)
    layer = Linear(64, 40, bias=True).to(DEVICE)
    layer.gemv_plan = {1: CANDIDATES[0], 3: CANDIDATES[2]}
    for m in (1, 2, 3):
        x = torch.randn(m, 64, device=DEVICE)
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)
    assert rows == [1, 3]


@pytest.mark.gpu
def test_a_decode_chain_gives_the_same_bits_with_and_without_pdl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16, fp8 and int4 products launched with PDL (kernels/pdl.py) in a chain in which
    every kernel reads the one before's output, eagerly and graphed, equal the chain launched
    without PDL, bit for bit."""
    from kernels.fp8_gemv import fp8_gemv
    from kernels.fp8_weights import quantize_rows
    from kernels.pdl import pdl_enabled
    from kernels.w4a16 import pack_int4
    from kernels.w4a16_gemv import w4a16_gemv

    if not pdl_enabled(DEVICE):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    gen = torch.Generator().manual_seed(5)
    d = 2048
    w16 = randn(d, d, dtype=torch.bfloat16, gen=gen, scale=0.05)
    q8, s8 = quantize_rows(randn(d, d, dtype=torch.float32, gen=gen, scale=0.05))
    q4 = pack_int4(torch.randint(0, 16, (d, d), generator=gen)).to(DEVICE)
    s4 = (torch.rand(d, d // 128, generator=gen) * 0.002).to(DEVICE, torch.float16)
    z4 = torch.full((d, d // 128), 8, dtype=torch.uint8, device=DEVICE)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = gemv(x, w16)
            x = fp8_gemv(x, q8, s8)
            x = w4a16_gemv(x, q4, s4, z4, group_size=128)
        return x

    for m in (1, MAX_M):
        assert_pdl_changes_no_bit(chain, randn(m, d, dtype=torch.bfloat16, gen=gen), monkeypatch)


@pytest.mark.parametrize("m", [1, 4])
def test_fp32_out_keeps_the_sums_unrounded(m: int) -> None:
    """out_dtype=float32 (DeepSeek's router logits): bf16 x and weight, the fp32 sums as
    F.linear(x.float(), w.float()) gives them, not rounded to bf16 on the way."""
    gen = torch.Generator().manual_seed(11 + m)
    x = randn(m, 300, dtype=torch.bfloat16, gen=gen)
    w = randn(70, 300, dtype=torch.bfloat16, gen=gen, scale=0.05)
    got = gemv(x, w, out_dtype=torch.float32, block_n=8, block_k=64)
    want = gemv_ref(x, w, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, want.to(torch.bfloat16).float())  # really fp32 sums
    with pytest.raises(ValueError, match="out_dtype must be"):
        gemv(x, w, out_dtype=torch.float16)
