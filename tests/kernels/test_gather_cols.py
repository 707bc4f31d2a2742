"""gather_columns (x's columns through an act-order perm) against its torch twin: padding
columns read as 0 whatever x holds at column 0, rows of any stride, several blocks, and bad
arguments refused by name."""

from __future__ import annotations

import pytest
import torch

from kernels.gather_cols import BLOCK, gather_columns, gather_columns_ref
from tests.kernels.helpers import ALL_DTYPES, DEVICE, randn


def _perm(k_in: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k entries: a permutation of x's k_in columns with k - k_in padding entries (-1)
    scattered among them."""
    perm = torch.full((k,), -1, dtype=torch.int32)
    real = torch.randperm(k, generator=gen)[:k_in]
    perm[real] = torch.randperm(k_in, generator=gen).to(torch.int32)
    return perm.to(DEVICE)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("m", "k_in", "k"), [(1, 96, 128), (3, 200, 200), (5, BLOCK + 7, BLOCK + 40)]
)
def test_matches_reference(m: int, k_in: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = randn(m, k_in, dtype=dtype, gen=gen)
    x[:, 0] = float("nan")  # padding must not read column 0 (nor anything)
    perm = _perm(k_in, k, gen)
    got = gather_columns(x, perm)
    assert got.shape == (m, k) and got.is_contiguous()
    want = gather_columns_ref(x, perm)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    padding = (perm < 0).nonzero().flatten()
    assert bool((got[:, padding] == 0).all())
    # every real column of x appears once, at the place perm names
    real = (perm >= 0).nonzero().flatten()
    assert torch.equal(
        got[:, real].isnan().sum(dim=1), torch.ones(m, dtype=torch.long, device=DEVICE)
    )


def test_strided_rows_and_empty() -> None:
    gen = torch.Generator().manual_seed(7)
    wide = randn(4, 300, dtype=torch.float16, gen=gen)
    x = wide[:, 10:138]  # row stride 300
    perm = _perm(128, 140, gen)
    torch.testing.assert_close(gather_columns(x, perm), gather_columns_ref(x, perm), rtol=0, atol=0)
    assert gather_columns(wide[:0], perm).shape == (0, 140)


@pytest.mark.parametrize(
    ("x", "perm", "match"),
    [
        (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), "x must"),
        (torch.zeros(2, 8), torch.zeros(8, dtype=torch.int64), "perm must"),
        (torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.int32), "perm must"),
        (torch.zeros(8), torch.zeros(8, dtype=torch.int32), "x must"),
    ],
)
def test_rejects_bad_arguments(x: torch.Tensor, perm: torch.Tensor, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        gather_columns(x.to(DEVICE), perm.to(DEVICE))
