"""The launchers' host-side block sizing (kernels/_checks.next_pow2) gives what Triton's
next_power_of_2 gives, which it replaced on the eager launch path."""

from __future__ import annotations

import triton

from kernels._checks import next_pow2


def test_next_pow2_matches_triton_from_zero_to_large_sizes() -> None:
    sizes = [*range(0, 4097), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 3 * 2**40]
    for n in sizes:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert [next_pow2(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
