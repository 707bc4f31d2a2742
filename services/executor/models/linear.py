"""Projections that take kernels/gemv for the few-row products of small decode batches, where
it reads the weight faster than cuBLAS, and cuBLAS everywhere else.

Which one is faster depends on the GPU and the shape, so nothing is assumed: `choose_gemv`
times both on the device at start (before the model's CUDA graphs are captured, each inside
a graph of its own, as decode runs them) for every projection shape of the model and every
row count up to kernels.gemv.MAX_M, and each `Linear` keeps the winner per row count.
Without a choice (the CPU, tests) a `Linear` is nn.Linear.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T through kernels/gemv with this launch configuration."""
        from kernels.gemv import gemv

        return gemv(
            x,
            weight,
            block_n=self.block_n,
            block_k=self.block_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


# Launch configurations tried against cuBLAS: rows per program x columns per step.
CANDIDATES = (
    GemvConfig(8, 512, 4, 3),
    GemvConfig(16, 256, 4, 3),
    GemvConfig(4, 512, 4, 4),
    # fewer rows a program, deeper K steps: more programs for the small projections of MoE
    # and MLA models (2,048 to 5,120 outputs), whose last wave otherwise runs half empty
    GemvConfig(4, 1024, 4, 3),
    GemvConfig(2, 1024, 4, 4),
    GemvConfig(8, 1024, 8, 3),
)


class Linear(nn.Linear):
    """nn.Linear whose forward takes the gemv kernel for the row counts in `gemv_plan`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_plan: dict[int, GemvConfig] = {}  # rows of x -> the kernel's configuration

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.gemv_plan.get(x.shape[0]) if x.dim() == 2 else None
        if gemv is None:
            return F.linear(x, self.weight, self.bias)
        out = gemv(x, self.weight)
        return out if self.bias is None else out + self.bias


def _time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds per call of `fn`, replayed from a CUDA graph of `reps` calls (median
    of three replays). Decode runs its projections inside CUDA graphs, where a launch costs
    the host nothing: timed eagerly, a short kernel would be judged by its launcher's host
    overhead (Triton's is several times torch's), and cuBLAS would win shapes it loses."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compiles; allocations settle before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end) / reps)
    del graph
    return sorted(times)[1]


def _plan(weight: torch.Tensor) -> tuple[dict[int, GemvConfig], float]:
    """The faster gemv configuration per row count, where one beats cuBLAS, and the
    microseconds saved over row counts 1 to MAX_M."""
    from kernels.gemv import MAX_M

    plan: dict[int, GemvConfig] = {}
    saved = 0.0
    for m in range(1, MAX_M + 1):
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
        cublas_us = best_us = _time_us(partial(F.linear, x, weight))
        for cfg in CANDIDATES:
            try:
                us = _time_us(partial(cfg, x, weight))
            except Exception as e:  # e.g. out of shared memory on this GPU: skip it
                log.warning("gemv %s does not run for %s: %s", cfg, tuple(weight.shape), e)
                continue
            if us < best_us:
                best_us, plan[m] = us, cfg
        saved += cublas_us - best_us
    return plan, saved


@torch.inference_mode()
def choose_gemv(model: nn.Module) -> dict[str, float]:
    """Time cuBLAS and each gemv configuration for every distinct projection shape and row
    count; give each Linear the kernel where it wins. Returns microseconds saved per
    weight shape ("NxK"), summed over row counts (for the log)."""
    from kernels.gemv import MAX_M

    plans: dict[tuple[int, int, torch.dtype], dict[int, GemvConfig]] = {}
    saved: dict[str, float] = {}
    for layer in model.modules():
        if not isinstance(layer, Linear) or not layer.weight.is_cuda:
            continue
        w = layer.weight
        key = (w.shape[0], w.shape[1], w.dtype)
        if key not in plans:
            plans[key], saved[f"{key[0]}x{key[1]}"] = _plan(w)
        layer.gemv_plan = dict(plans[key])
    for shape, us in saved.items():
        log.info("gemv for %s: %.1f us saved per call over row counts 1-%d", shape, us, MAX_M)
    return saved
