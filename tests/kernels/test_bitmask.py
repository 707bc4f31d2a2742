"""apply_token_bitmask against its torch twin and against bits unpacked by hand."""

from __future__ import annotations

import pytest
import torch

from kernels.bitmask import apply_token_bitmask, apply_token_bitmask_ref
from tests.kernels.helpers import ALL_DTYPES, DEVICE, randn


def random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, cdiv(vocab, 32)] int32 with random bits, sign bits included."""
    words = torch.randint(-(2**31), 2**31, (rows, (vocab + 31) // 32), generator=gen)
    return words.to(torch.int32).to(DEVICE)


def allowed_by_hand(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, from one bit at a time."""
    words = bitmask.cpu().tolist()
    return torch.tensor(
        [[(row[j // 32] >> (j % 32)) & 1 == 1 for j in range(vocab)] for row in words]
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("bs", "vocab", "indices"),
    [(1, 64, None), (3, 100, [2, 0]), (8, 5000, [1, 3, 4, 7]), (3, 33, [])],
)
def test_matches_reference(
    bs: int, vocab: int, indices: list[int] | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(bs * 10000 + vocab)
    logits = randn(bs, vocab, dtype=dtype, gen=gen)
    bitmask = random_bitmask(bs, vocab, gen)
    idx = None if indices is None else torch.tensor(indices, dtype=torch.int64, device=DEVICE)
    before = logits.clone()
    expected = logits.clone()
    apply_token_bitmask(logits=logits, bitmask=bitmask, indices=idx)
    apply_token_bitmask_ref(logits=expected, bitmask=bitmask, indices=idx)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)

    masked_rows = list(range(bs)) if indices is None else indices
    allowed = allowed_by_hand(bitmask, vocab)
    for row in range(bs):
        got = logits[row].cpu()
        if row in masked_rows:
            assert got[~allowed[row]].eq(float("-inf")).all()
            torch.testing.assert_close(got[allowed[row]], before[row].cpu()[allowed[row]])
        else:
            torch.testing.assert_close(got, before[row].cpu(), rtol=0, atol=0)


def test_padded_vocab_and_strided_rows() -> None:
    """Logits wider than the bitmask covers (a padded vocab) keep the tail; rows strided."""
    gen = torch.Generator().manual_seed(1)
    wide = randn(2, 200, dtype=torch.float32, gen=gen)
    logits = wide[:, :150]  # row stride 200; the bitmask covers 4 words = 128 tokens
    bitmask = random_bitmask(2, 128, gen)
    before = wide.clone()
    apply_token_bitmask(logits=logits, bitmask=bitmask)
    allowed = allowed_by_hand(bitmask, 128).to(DEVICE)
    assert logits[:, :128][~allowed].eq(float("-inf")).all()
    torch.testing.assert_close(logits[:, :128][allowed], before[:, :128][allowed])
    torch.testing.assert_close(wide[:, 128:], before[:, 128:], rtol=0, atol=0)


def test_all_allowed_and_none_allowed() -> None:
    logits = torch.zeros(2, 40, device=DEVICE)
    bitmask = torch.tensor([[-1, -1], [0, 0]], dtype=torch.int32, device=DEVICE)
    apply_token_bitmask(logits=logits, bitmask=bitmask)
    assert logits[0].eq(0).all() and logits[1].eq(float("-inf")).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logits": torch.zeros(2, 3, 4)}, ValueError, r"logits must have shape \[bs, vocab\]"),
        ({"bitmask": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, r"bitmask must have"),
        ({"bitmask": torch.zeros(2, 2, dtype=torch.int64)}, TypeError, r"bitmask must be one"),
        ({"indices": torch.zeros(2, 1, dtype=torch.int64)}, ValueError, r"indices must have"),
        ({"indices": torch.zeros(2)}, TypeError, r"indices must be one of int32, int64"),
    ],
)
def test_rejects_bad_arguments(
    kwargs: dict[str, torch.Tensor], error: type[Exception], match: str
) -> None:
    args: dict[str, torch.Tensor] = {
        "logits": torch.zeros(2, 40),
        "bitmask": torch.zeros(2, 2, dtype=torch.int32),
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        apply_token_bitmask(**{name: t.to(DEVICE) for name, t in args.items()})
