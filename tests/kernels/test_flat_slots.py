"""kernels/flat_slots against its torch twin: each request's row of the request table, its
first seq_len slots, one request after another."""

from __future__ import annotations

import pytest
import torch

from kernels.flat_slots import flat_slots, flat_slots_ref, kv_indptr
from tests.kernels.helpers import DEVICE


@pytest.mark.parametrize(
    "seq_lens",
    [[1], [5, 0, 700, 3], [1030, 1, 512, 513], [0, 0]],
    ids=["one", "with-empty", "past-a-block", "all-empty"],
)
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_matches_the_rows_of_the_table(seq_lens: list[int], table_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    width = 1100
    table = torch.randint(0, 10**6, (8, width), generator=gen).to(table_dtype).to(DEVICE)
    rows = torch.randperm(8, generator=gen)[: len(seq_lens)].to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    indptr = kv_indptr(lens)
    assert indptr.tolist() == [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    out = torch.full((sum(seq_lens) + 7,), -1, dtype=torch.int32, device=DEVICE)
    flat_slots(req_to_token=table, req_rows=rows, indptr=indptr, max_len=width, out=out)
    want = flat_slots_ref(table, rows, lens)
    assert torch.equal(out[: sum(seq_lens)], want)
    assert (out[sum(seq_lens) :] == -1).all()  # nothing written past the last request


def test_a_wrong_index_dtype_is_refused() -> None:
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    indptr = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="indptr must be one of int32"):
        flat_slots(req_to_token=table, req_rows=rows, indptr=indptr, max_len=4, out=out)
