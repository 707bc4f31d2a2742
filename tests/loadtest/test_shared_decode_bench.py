"""The shared_decode section's request tables (the kernel timing itself needs a GPU)."""

from __future__ import annotations

import torch

from loadtest import gpu_bench
from loadtest.gpu.shared_decode import BATCH, request_table


def test_a_group_shares_its_prefix_slots_and_nothing_else() -> None:
    table, rows, slots = request_table(4, 32, 8, shuffled=False)
    assert table.shape == (BATCH, 40) and rows.tolist() == list(range(BATCH))
    assert slots == BATCH // 4 * 32 + BATCH * 8
    for b in range(BATCH):
        assert torch.equal(table[b, :32], table[b - b % 4, :32])
    # each group's prefix once, each request's own keys once: every slot used exactly once
    used = torch.cat([table[::4, :32].flatten(), table[:, 32:].flatten()])
    assert sorted(used.tolist()) == list(range(slots))


def test_without_groups_every_context_is_its_own_and_rows_can_be_shuffled() -> None:
    table, rows, slots = request_table(0, 0, 16, shuffled=True)
    assert slots == BATCH * 16 and len(set(table.flatten().tolist())) == slots
    assert sorted(rows.tolist()) == list(range(BATCH)) and rows.tolist() != list(range(BATCH))


def test_the_sections_are_registered() -> None:
    for name in ("shared_decode", "long_prefill"):
        assert name in gpu_bench.TIME_LIMITS
