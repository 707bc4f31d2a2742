"""The fp8 (w8a16) tensor-core GEMM of decode batches past the GEMV's rows, against its torch
twin: per-row and 128x128 block scales, ragged shapes, splits of K, strided views, refusals."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from tests.kernels.helpers import DEVICE, DOT_DTYPES, poison, randn
from tests.kernels.test_fp8_gemv import fp8_weight

# fp32 sums in another order than the twin's matmul, then one rounding to x's dtype (the
# widened weights and x are exact in the dot's dtype)
ROUNDING = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("block_scales", [False, True], ids=["rows", "blocks"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "block_k", "split"),
    [
        (5, 16, 128, 128, None),  # one tile
        (17, 37, 300, 64, 2),  # ragged rows, outputs and K; two splits, one of them short
        (9, 260, 515, 32, 4),  # four splits; K ends inside a block and a step
    ],
)
def test_matches_reference(
    m: int, n: int, k: int, block_k: int, split: int | None, dtype: torch.dtype, block_scales: bool
) -> None:
    q, scale = fp8_weight(n, k, block_scales, seed=n + k)
    x = randn(m, k, dtype=dtype, gen=torch.Generator().manual_seed(m), scale=1.0)
    out = poison(torch.empty(m, n, dtype=dtype, device=DEVICE))
    got = fp8_gemm(
        x, q, scale, block_scales=block_scales, out=out, block_n=16, block_k=block_k,
        split=split, num_warps=1,
    )  # fmt: skip
    assert got is out
    tol = ROUNDING[dtype]
    want = fp8_gemm_ref(x, q, scale, block_scales=block_scales)
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


def test_splits_sum_in_order_and_strided_views() -> None:
    """K split over 8 programs: the same bits every call; x, weight and out as views whose
    rows are wider than they are."""
    q, scale = fp8_weight(24, 1024, False, seed=5)
    wide = torch.zeros(24, 1100, dtype=q.dtype, device=DEVICE)
    wide[:, :1024] = q
    x = randn(6, 1030, dtype=torch.float32, gen=torch.Generator().manual_seed(6))[:, :1024]
    out = poison(torch.empty(6, 30, dtype=torch.float32, device=DEVICE))[:, :24]
    runs = [fp8_gemm(x, wide[:, :1024], scale, block_n=16, split=8).clone() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    fp8_gemm(x, wide[:, :1024], scale, out=out, block_n=16, split=8)
    assert torch.equal(out, runs[0])
    torch.testing.assert_close(out, fp8_gemm_ref(x, q, scale), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_n": 8}, ValueError, r"block_n must be a power of two >= 16"),
        (
            {"block_k": 256, "block_scales": True, "scale": torch.ones(1, 2)},
            ValueError,
            r"block_k must be at most 128",
        ),
        ({"split": 3}, ValueError, r"split must be a power of two"),
        ({"scale": torch.ones(16, 2)}, ValueError, r"scale must have shape \[n, 1\]"),
        ({"weight": torch.zeros(16, 256)}, TypeError, r"weight must be one of float8_e4m3fn"),
    ],
)
def test_refuses_bad_arguments(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    q, scale = fp8_weight(16, 256, False, seed=7)
    args: dict[str, object] = {"weight": q, "scale": scale, **kwargs}
    for key in ("weight", "scale"):
        args[key] = args[key].to(DEVICE)  # type: ignore[attr-defined]
    with pytest.raises(error, match=match):
        fp8_gemm(torch.zeros(5, 256, device=DEVICE), **args)  # type: ignore[arg-type]
