"""kernels/expand_mm: the slices it expands W in, and the product they make."""

from __future__ import annotations

import torch

from kernels.expand_mm import SLICE_ALIGN, expand_mm


def run(n: int, k: int, chunk_elems: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    slices: list[tuple[int, int]] = []

    def expand(n0: int, n1: int, buf: torch.Tensor) -> torch.Tensor:
        slices.append((n0, n1))
        buf.copy_(w[n0:n1])
        return buf

    out = torch.full((3, n), float("nan"))
    expand_mm(x, out, expand, chunk_elems=chunk_elems)
    torch.testing.assert_close(out, x @ w.T)
    return slices, out


def test_slices_of_several_start_on_the_alignment() -> None:
    # 2.5 aligned slices fit the bound: the slices are 2 x SLICE_ALIGN rows, not 2.5 x.
    slices, _ = run(5 * SLICE_ALIGN + 9, 4, chunk_elems=4 * (5 * SLICE_ALIGN // 2))
    step = 2 * SLICE_ALIGN
    assert slices == [(0, step), (step, 2 * step), (2 * step, 5 * SLICE_ALIGN + 9)]


def test_one_slice_when_the_weight_fits() -> None:
    slices, _ = run(SLICE_ALIGN + 3, 4, chunk_elems=4 * (SLICE_ALIGN + 3))
    assert slices == [(0, SLICE_ALIGN + 3)]


def test_slices_under_the_alignment_keep_the_bound() -> None:
    # Rows past k's bound would exceed the scratch; fewer rows than SLICE_ALIGN stay as they are.
    slices, _ = run(13, 4, chunk_elems=5 * 4 + 3)
    assert slices == [(0, 5), (5, 10), (10, 13)]
