"""Programmatic dependent launch (kernels/pdl.py): when it is on, and that a decode step's
kernel chain gives the same bits with it as without it, eagerly and replayed from a graph."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import gemv
from kernels.moe_gemv import moe_gemv
from kernels.moe_topk import moe_topk
from kernels.pdl import pdl_enabled, pdl_launch
from kernels.rmsnorm import rmsnorm
from tests.kernels.helpers import DEVICE, INTERPRETING, randn


def test_off_on_the_cpu_and_under_the_interpreter() -> None:
    assert pdl_launch(torch.device("cpu")) == {"PDL": False}
    if INTERPRETING:
        assert not pdl_enabled(torch.device("cuda:0"))  # the interpreter has no launch attribute


@pytest.mark.gpu
def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_PDL", "0")
    assert pdl_launch(DEVICE) == {"PDL": False}


def _chain(x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A MoE layer's decode kernels back to back, each reading the one before's output:
    norm, projection, routing, experts, norm, projection."""
    h, _ = rmsnorm(x, params["norm"], 1e-6)
    h = gemv(h, params["proj"])
    weights, ids = moe_topk(gemv(h, params["router"]).float(), top_k=4, renormalise=True)
    h = moe_gemv(h, params["w13"], params["w2"], weights, ids)
    h, _ = rmsnorm(h, params["norm"], 1e-6)
    return gemv(h, params["proj"])


@pytest.mark.gpu
def test_a_kernel_chain_gives_the_same_bits_with_and_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not pdl_enabled(DEVICE):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    gen = torch.Generator().manual_seed(0)
    hidden, inter, experts = 1024, 512, 32
    params = {
        "norm": randn(hidden, dtype=torch.bfloat16, gen=gen),
        "proj": randn(hidden, hidden, dtype=torch.bfloat16, gen=gen, scale=hidden**-0.5),
        "router": randn(experts, hidden, dtype=torch.bfloat16, gen=gen, scale=hidden**-0.5),
        "w13": randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, gen=gen, scale=0.03),
        "w2": randn(experts, hidden, inter, dtype=torch.bfloat16, gen=gen, scale=0.04),
    }
    x = randn(2, hidden, dtype=torch.bfloat16, gen=gen)
    with_pdl = _chain(x, params)
    graph = torch.cuda.CUDAGraph()
    _chain(x, params)  # compiled before capture
    with torch.cuda.graph(graph):
        graphed = _chain(x, params)
    graph.replay()
    monkeypatch.setenv("RADIXSERVE_PDL", "0")
    without = _chain(x, params)
    torch.cuda.synchronize()
    assert torch.equal(with_pdl, without)
    assert torch.equal(graphed, without)
