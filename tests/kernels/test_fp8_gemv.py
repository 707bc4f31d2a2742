"""fp8_gemv against its torch twin: every row count, per-row and 128x128 block scales with
partial blocks, every launch configuration choose_gemv may pick, strided rows, bad arguments;
and its packed launches (kernels/fp8_gemv_packed.py: fp16-pair products over x scaled per
thread): x over many orders of magnitude, zeros, infinities and NaN."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref
from kernels.fp8_weights import BLOCK, dequantize, quantize_blocks, quantize_rows
from kernels.gemv import MAX_M
from tests.kernels.helpers import ALL_DTYPES, DEVICE, poison, randn, spread_params

# fp32 sums in another order than the reference's matmul, then one rounding to x's dtype
ROUNDING = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def fp8_weight(n: int, k: int, block_scales: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = randn(n, k, dtype=torch.float32, gen=gen, scale=0.1)
    # rows of very different sizes: a scale applied to the wrong rows shows
    w *= torch.linspace(0.1, 3.0, n, device=w.device)[:, None]
    return quantize_blocks(w) if block_scales else quantize_rows(w)


@pytest.mark.parametrize("block_scales", [False, True], ids=["rows", "blocks"])
@pytest.mark.parametrize(
    ("m", "n", "k", "dtype"),
    spread_params(
        [(m, n, k) for m in range(1, MAX_M + 1) for n, k in [(8, 128), (37, 300), (260, 515)]],
        ALL_DTYPES,
    ),
)
def test_matches_reference(m: int, n: int, k: int, dtype: torch.dtype, block_scales: bool) -> None:
    q, scale = fp8_weight(n, k, block_scales, seed=n + k)
    x = randn(m, k, dtype=dtype, gen=torch.Generator().manual_seed(m), scale=1.0)
    out = poison(torch.empty(m, n, dtype=dtype, device=DEVICE))
    got = fp8_gemv(x, q, scale, block_scales=block_scales, out=out, block_n=8, block_k=256)
    assert got is out
    want = fp8_gemv_ref(x, q, scale, block_scales=block_scales)
    tol = ROUNDING[dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_scales", [False, True], ids=["rows", "blocks"])
@pytest.mark.parametrize(("n", "k"), [(131, 700), (16, 2048)], ids=["ragged", "whole-tiles"])
def test_every_configuration_choose_gemv_may_pick(n: int, k: int, block_scales: bool) -> None:
    """Ragged shapes: the widening kernel's launches, and a packed one, which falls back to
    it; whole tiles: the packed launches, which then run the packed kernel. The ragged shape
    is partial in every launch's rows and steps, and spans two block rows and six block
    columns (the last partial) of 128x128 scales."""
    from services.executor.quant.fp8_linear import FP8_CANDIDATES

    q, scale = fp8_weight(n, k, block_scales, seed=9)
    # two rows of x: each row count's own code is test_matches_reference's and
    # test_packed_matches_reference's; here, every launch's tiling
    x = randn(2, k, dtype=torch.bfloat16, gen=torch.Generator().manual_seed(2))
    want = fp8_gemv_ref(x, q, scale, block_scales=block_scales)
    packed = [c for c in FP8_CANDIDATES if c.packed]
    launches = [c for c in FP8_CANDIDATES if not c.packed] + packed[:1] if n % 8 else packed
    assert packed and any(c.packed for c in launches)
    for c in launches:
        got = fp8_gemv(
            x, q, scale, block_scales=block_scales, block_n=c.block_n, block_k=c.block_k,
            num_warps=c.num_warps, num_stages=c.num_stages, packed=c.packed,
        )  # fmt: skip
        torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2, msg=str(c))


def _packed(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_scales: bool = False
) -> torch.Tensor:
    out = poison(torch.empty(x.shape[0], q.shape[0], dtype=x.dtype, device=DEVICE))
    got = fp8_gemv(
        x, q, scale, block_scales=block_scales, out=out, block_n=8, block_k=512, num_warps=1,
        packed=True,
    )  # fmt: skip
    assert got is out
    return out


# an ulp of the output's dtype, relative (the interpreter truncates fp32 to bf16: up to an ulp)
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.mark.parametrize("block_scales", [False, True], ids=["rows", "blocks"])
@pytest.mark.parametrize(
    ("m", "dtype"),
    [(1, torch.bfloat16), (2, torch.float16), (3, torch.bfloat16), (4, torch.float16)],
    ids=["m1-bf16", "m2-fp16", "m3-bf16", "m4-fp16"],
)
def test_packed_matches_reference(m: int, dtype: torch.dtype, block_scales: bool) -> None:
    """Against the exact product: each lane sums 8 products in fp16 (a rounding of 2^-11 of
    that partial sum each), so the error is bounded by the sum of |products|, the L1, times
    2^-10 here (measured: 0.73 x 2^-11), plus the output's own rounding."""
    q, scale = fp8_weight(16, 1024, block_scales, seed=m)
    x = randn(m, 1024, dtype=dtype, gen=torch.Generator().manual_seed(m), scale=1.0)
    w = dequantize(q, scale, BLOCK if block_scales else 0)
    exact = x.float() @ w.T
    l1 = x.float().abs() @ w.abs().T
    got = _packed(x, q, scale, block_scales=block_scales).float()
    assert bool(((got - exact).abs() <= 2.0**-10 * l1 + ULP[dtype] * exact.abs()).all())


def test_packed_x_over_many_magnitudes() -> None:
    """Each thread's 16 columns get their own power of two: columns of 1e-30 next to columns
    of 1e4 (fp16's range is 6e-8 to 65,504) lose nothing the bf16 result keeps, and a row
    whose every column is tiny is as exact as one of ordinary size."""
    gen = torch.Generator().manual_seed(3)
    q, scale = fp8_weight(16, 2048, False, seed=4)
    x = randn(3, 2048, dtype=torch.float32, gen=gen)
    x[0] *= torch.logspace(-30, 4, 2048, device=DEVICE)  # ascending: 16 columns share a size
    x[1] *= 1e-25
    x[2, ::2] *= 3e4  # large and ordinary columns in the same thread's 16
    x = x.to(torch.bfloat16)
    got = _packed(x, q, scale).float()
    want = fp8_gemv_ref(x, q, scale).float()
    for row in range(3):  # to bf16's rounding of each row's own size
        size = want[row].abs().max()
        assert size > 0
        torch.testing.assert_close(got[row] / size, want[row] / size, atol=8e-3, rtol=0)


def test_packed_zeros_infinities_and_nan() -> None:
    q, scale = fp8_weight(8, 512, False, seed=5)
    x = torch.zeros(4, 512, dtype=torch.bfloat16, device=DEVICE)
    x[1, 7] = float("inf")
    x[2, 300] = float("nan")
    x[3] = 1.0
    x[3, 17] = float("-inf")
    got = _packed(x, q, scale)
    want = fp8_gemv_ref(x, q, scale)
    assert bool((got[0] == 0).all())
    torch.testing.assert_close(got[1:], want[1:], equal_nan=True)


def test_packed_rejects_warps_other_than_its_step() -> None:
    q, scale = fp8_weight(8, 1024, False, seed=6)
    x = torch.zeros(1, 1024, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="block_k=1024 columns is 2 warps"):
        fp8_gemv(x, q, scale, block_k=1024, num_warps=4, packed=True)


def test_strided_rows_of_x_and_weight() -> None:
    q, scale = fp8_weight(24, 384, True, seed=1)
    wide = torch.zeros(24, 512, dtype=q.dtype, device=DEVICE)
    wide[:, :384] = q
    x = randn(2, 500, dtype=torch.float32, gen=torch.Generator().manual_seed(1))[:, :384]
    got = fp8_gemv(x, wide[:, :384], scale, block_scales=True, block_k=128)
    torch.testing.assert_close(
        got, fp8_gemv_ref(x, q, scale, block_scales=True), atol=1e-4, rtol=1e-4
    )


@pytest.mark.gpu
@pytest.mark.parametrize("block_scales", [False, True], ids=["rows", "blocks"])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("warps", [0, 1, 2, 4], ids=["widening", *"124"])
def test_llama_8b_projection_shapes(m: int, n: int, k: int, block_scales: bool, warps: int) -> None:
    """On the GPU: the widening kernel (0) to fp32's rounding; the packed one at each step
    width within its bound (the L1 of the products times 2^-10, as above) and, over the
    whole output, within bf16's rounding of it."""
    q, scale = fp8_weight(n, k, block_scales, seed=n + k)
    x = randn(m, k, dtype=torch.bfloat16, gen=torch.Generator().manual_seed(m))
    if not warps:
        want = fp8_gemv_ref(x, q, scale, block_scales=block_scales)
        got = fp8_gemv(x, q, scale, block_scales=block_scales)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=1.6e-2)
        return
    got = fp8_gemv(
        x, q, scale, block_scales=block_scales, block_k=warps * 512, num_warps=warps, packed=True
    ).float()
    w = dequantize(q, scale, BLOCK if block_scales else 0)
    exact = x.float() @ w.T
    l1 = x.float().abs() @ w.abs().T
    assert bool(((got - exact).abs() <= 2.0**-10 * l1 + ULP[torch.bfloat16] * exact.abs()).all())
    assert (got - exact).norm() <= 2.0**-8 * exact.norm()


@pytest.mark.parametrize(
    ("m", "scale_shape", "kwargs", "match"),
    [
        (MAX_M + 1, (4, 1), {}, "1 to 4 rows"),
        (1, (4,), {}, r"scale must have shape \[n, 1\]"),
        (1, (4, 1), {"block_scales": True}, r"scale must have shape \[ceil\(n/128\)"),
        (1, (1, 1), {"block_scales": True, "block_k": 64}, "multiple of 128"),
    ],
)
def test_rejects_bad_arguments(
    m: int, scale_shape: tuple[int, ...], kwargs: dict[str, object], match: str
) -> None:
    q = torch.zeros(4, 128, device=DEVICE).to(torch.float8_e4m3fn)
    scale = torch.ones(scale_shape, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        fp8_gemv(torch.zeros(m, 128, device=DEVICE), q, scale, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="weight must be one of float8_e4m3fn"):
        fp8_gemv(torch.zeros(1, 128, device=DEVICE), q.float(), torch.ones(4, 1, device=DEVICE))
