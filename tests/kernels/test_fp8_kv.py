"""quantize_kv, the cast every fp8 pool writer follows: saturating at the format's largest
finite value, round to nearest even below it, a plain cast for other dtypes."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import FP8_FORMATS, gather_kv, is_fp8, quantize_kv, store_into

INF = float("inf")


# Overflows, ties between two neighbours of one format (the even one wins), subnormal ties.
OVERFLOWS = [500.0, -1e6, INF, -INF, 464.0]
TIES = [1.0625, 1.1875, 1.125, 1.375]
SUBNORMAL_TIES = [2.0**-10, 1.5 * 2.0**-9, 2.0**-17, 1.5 * 2.0**-16]
EXPECTED = {
    # e4m3fn: no inf, so every overflow is 448; spacing 1/8 at 1; subnormals 2^-9 apart.
    torch.float8_e4m3fn: (
        [448.0, -448.0, 448.0, -448.0, 448.0],
        [1.0, 1.25, 1.125, 1.375],
        [0.0, 2.0**-8, 0.0, 0.0],
    ),
    # e5m2: 500 rounds to 512 in range; spacing 1/4 at 1; subnormals 2^-16 apart.
    torch.float8_e5m2: (
        [512.0, -57344.0, 57344.0, -57344.0, 448.0],
        [1.0, 1.25, 1.0, 1.5],
        [2.0**-10, 1.5 * 2.0**-9, 0.0, 2.0**-15],
    ),
}


@pytest.mark.parametrize("dtype", list(EXPECTED))
def test_saturates_and_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    for inputs, expected in zip((OVERFLOWS, TIES, SUBNORMAL_TIES), EXPECTED[dtype], strict=True):
        got = quantize_kv(torch.tensor(inputs), dtype)
        assert got.dtype == dtype
        assert got.float().tolist() == expected


def test_nan_stays_nan_and_other_dtypes_are_a_plain_cast() -> None:
    nan = torch.tensor([float("nan")])
    for dtype in FP8_FORMATS:
        assert quantize_kv(nan, dtype).float().isnan().all()
    x = torch.tensor([1e6, 1.0 + 2.0**-12])
    assert quantize_kv(x, torch.bfloat16).tolist() == x.to(torch.bfloat16).tolist()
    assert quantize_kv(x, torch.float16).tolist() == [INF, 1.0]  # no clamp outside fp8
    assert is_fp8(torch.float8_e5m2) and is_fp8(torch.float8_e4m3fn)
    assert not is_fp8(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *FP8_FORMATS])
def test_gather_and_store_into_index_any_pool_dtype(dtype: torch.dtype) -> None:
    """The byte-view indexing used for fp8 pools reads and writes what plain indexing of a
    quantised copy would."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 4, generator=gen) * 1000  # beyond e4m3's range: saturates
    buf = torch.zeros(10, 2, 4, dtype=dtype)
    slots = torch.tensor([7, 0, 3, 9, 4, 1])
    store_into(buf, slots, x)
    want = quantize_kv(x, dtype)
    assert torch.equal(gather_kv(buf, slots).float(), want.float())
    assert torch.equal(
        gather_kv(buf, torch.tensor([[2, 5], [6, 8]])).float(), torch.zeros(2, 2, 2, 4)
    )
