"""finite_argmax_rows (the sampler's greedy token on CUDA) against its torch twin: the first
largest finite entry of each row, 0 for a row with none, over row splits, ties across
programs, non-finite entries and strided rows."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import finite_argmax_ref, finite_argmax_rows
from tests.kernels.helpers import ALL_DTYPES, DEVICE, randn

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("rows", "vocab", "block"), [(1, 1, 16), (3, 100, 16), (5, 1000, 64), (2, 4097, 4096)]
)
def test_matches_reference(rows: int, vocab: int, block: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 10000 + vocab)
    logits = randn(rows, vocab, dtype=dtype, gen=gen, scale=3.0)
    got = finite_argmax_rows(logits, block=block)
    assert got.dtype == torch.int64
    assert got.tolist() == finite_argmax_ref(logits).tolist()


def test_a_tie_goes_to_the_first_index_even_across_programs() -> None:
    logits = torch.zeros(3, 200, device=DEVICE)
    logits[0, [150, 20, 199]] = 7.0  # programs of 16: the winner's program is not the first
    logits[1, [31, 32]] = 2.0  # the last entry of one program, the first of the next
    logits[2] = 1.5  # every entry ties
    assert finite_argmax_rows(logits, block=16).tolist() == [20, 31, 0]


def test_non_finite_entries_never_win_and_a_row_without_finite_ones_gives_zero() -> None:
    logits = torch.zeros(5, 50, device=DEVICE)
    logits[0, 40] = 3.0
    logits[0, [2, 45]] = torch.tensor([NAN, INF], device=DEVICE)
    logits[1] = -INF
    logits[2] = NAN
    logits[3, :] = -INF
    logits[3, 33] = -1e30  # a finite entry among -inf
    logits[4, [0, 17]] = torch.tensor([INF, 1.0], device=DEVICE)
    got = finite_argmax_rows(logits, block=16)
    assert got.tolist() == [40, 0, 0, 33, 17]
    assert got.tolist() == finite_argmax_ref(logits).tolist()


def test_strided_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = randn(4, 300, dtype=torch.float32, gen=gen)
    logits = wide[:, 10:210]  # row stride 300
    assert finite_argmax_rows(logits, block=32).tolist() == finite_argmax_ref(logits).tolist()


def test_no_rows_gives_no_tokens() -> None:
    assert finite_argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)


@pytest.mark.parametrize(
    ("logits", "kwargs", "error", "match"),
    [
        (torch.zeros(2, 0), {}, ValueError, r"no entries"),
        (torch.zeros(8), {}, ValueError, r"logits must have shape \[rows, V\]"),
        (torch.zeros(2, 8, dtype=torch.int64), {}, TypeError, r"logits must be one of"),
        (torch.zeros(2, 8), {"block": 48}, ValueError, r"block must be a power of two"),
    ],
)
def test_rejects_bad_arguments(
    logits: torch.Tensor, kwargs: dict[str, int], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        finite_argmax_rows(logits.to(DEVICE), **kwargs)


@pytest.mark.gpu
def test_llama_3_vocabulary() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = randn(3, 128256, dtype=torch.float32, gen=gen)
    logits[1, [5, 128255]] = 1e4  # the same largest at both ends
    got = finite_argmax_rows(logits)
    assert got.tolist() == finite_argmax_ref(logits).tolist()
    assert got[1] == 5
