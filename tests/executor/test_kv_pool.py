"""The request-to-slot table: writes are batched until the next flush, in order."""

from __future__ import annotations

import torch

from services.executor.kv_pool import ReqToTokenPool


def test_writes_reach_the_table_at_flush_in_one_scatter() -> None:
    table = ReqToTokenPool(max_reqs=3, max_context=8, device="cpu", pad_slot=99)
    a, b = table.allocate(), table.allocate()
    table.write(a, 0, [5, 6, 7])
    table.write(b, 2, [9])
    assert table.req_to_token[:3].eq(0).all()  # nothing written before the flush
    table.flush()
    assert table.req_to_token[a, :4].tolist() == [5, 6, 7, 0]
    assert table.req_to_token[b, :4].tolist() == [0, 0, 9, 0]
    assert table.req_to_token[table.pad_row].eq(99).all()


def test_a_later_write_to_the_same_row_wins() -> None:
    """The radix cache rewrites a prefix the request wrote before (switching it to the
    cache's copies): order must hold even within one flush."""
    table = ReqToTokenPool(max_reqs=2, max_context=6, device="cpu")
    row = table.allocate()
    for _ in range(50):  # a scatter with repeated indices would pick either value
        table.write(row, 0, [1, 2, 3, 4])
        table.write(row, 1, [20, 30])
        table.write(row, 4, [50])
        table.flush()
        assert table.req_to_token[row, :6].tolist() == [1, 20, 30, 4, 50, 0]
        table.req_to_token.zero_()


def test_flush_without_writes_is_free() -> None:
    table = ReqToTokenPool(max_reqs=1, max_context=4, device="cpu")
    before = table.req_to_token.clone()
    table.flush()
    assert torch.equal(table.req_to_token, before)
