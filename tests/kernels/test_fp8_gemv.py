"""fp8_gemv against its torch twin: every row count, per-row and 128x128 block scales with
partial blocks, every launch configuration choose_gemv may pick, strided rows, bad arguments."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref
from kernels.fp8_weights import quantize_blocks, quantize_rows
from kernels.gemv import MAX_M
from tests.kernels.helpers import ALL_DTYPES, DEVICE, poison, randn

# fp32 sums in another order than the reference's matmul, then one rounding to x's dtype
ROUNDING = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def fp8_weight(n: int, k: int, block_scales: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = randn(n, k, dtype=torch.float32, gen=gen, scale=0.1)
    # rows of very different sizes: a scale applied to the wrong rows shows
    w *= torch.linspace(0.1, 3.0, n, device=w.device)[:, None]
    return quantize_blocks(w) if block_scales else quantize_rows(w)


@pytest.mark.parametrize("block_scales", [False, True], ids=["rows", "blocks"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
@pytest.mark.parametrize(("n", "k"), [(8, 128), (37, 300), (260, 515)])
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
def test_every_configuration_choose_gemv_may_pick(block_scales: bool) -> None:
    from services.executor.quant.fp8_linear import FP8_CANDIDATES

    q, scale = fp8_weight(203, 1100, block_scales, seed=9)
    x = randn(3, 1100, dtype=torch.bfloat16, gen=torch.Generator().manual_seed(2))
    want = fp8_gemv_ref(x, q, scale, block_scales=block_scales)
    for c in FP8_CANDIDATES:
        got = fp8_gemv(
            x, q, scale, block_scales=block_scales, block_n=c.block_n, block_k=c.block_k,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
        torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2, msg=str(c))


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
def test_llama_8b_projection_shapes(m: int, n: int, k: int, block_scales: bool) -> None:
    q, scale = fp8_weight(n, k, block_scales, seed=n + k)
    x = randn(m, k, dtype=torch.bfloat16, gen=torch.Generator().manual_seed(m))
    want = fp8_gemv_ref(x, q, scale, block_scales=block_scales)
    torch.testing.assert_close(
        fp8_gemv(x, q, scale, block_scales=block_scales), want, atol=3e-2, rtol=1.6e-2
    )


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
