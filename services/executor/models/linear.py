"""Projections that take kernels/gemv for the few-row products of small decode batches, where
it reads the weight faster than cuBLAS, and cuBLAS everywhere else.

Which one is faster depends on the GPU and the shape, so nothing is assumed: `choose_gemv`
times both on the device at start (before CUDA graphs are captured) for every projection
shape of the model and every row count up to kernels.gemv.MAX_M, and each `Linear` keeps
the winner per row count. Without a choice (the CPU, tests) a `Linear` is nn.Linear.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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


# Launch configurations tried against cuBLAS: rows per program x columns per step.
CANDIDATES = (GemvConfig(8, 512, 4, 3), GemvConfig(16, 256, 4, 3), GemvConfig(4, 512, 4, 4))


class Linear(nn.Linear):
    """nn.Linear whose forward takes the gemv kernel for the row counts in `gemv_plan`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_plan: dict[int, GemvConfig] = {}  # rows of x -> the kernel's configuration

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.gemv_plan.get(x.shape[0]) if x.dim() == 2 else None
        if cfg is None:
            return F.linear(x, self.weight, self.bias)
        from kernels.gemv import gemv

        out = gemv(
            x,
            self.weight,
            block_n=cfg.block_n,
            block_k=cfg.block_k,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return out if self.bias is None else out + self.bias


def _time_us(fn: object, reps: int = 30) -> float:
    assert callable(fn)
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / reps


@torch.inference_mode()
def choose_gemv(model: nn.Module) -> dict[str, float]:
    """Time cuBLAS and each gemv configuration for every distinct projection shape and row
    count; give each Linear the kernel where it wins. Returns microseconds saved per
    `Linear` call shape, summed over row counts (for the log)."""
    from kernels.gemv import MAX_M, gemv

    layers = [m for m in model.modules() if isinstance(m, Linear) and m.weight.is_cuda]
    plans: dict[tuple[int, int, torch.dtype], dict[int, GemvConfig]] = {}
    saved: dict[str, float] = {}
    for layer in layers:
        w = layer.weight
        key = (w.shape[0], w.shape[1], w.dtype)
        if key not in plans:
            plans[key] = {}
            for m in range(1, MAX_M + 1):
                x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
                best_us = _time_us(lambda x=x, w=w: F.linear(x, w))
                cublas_us = best_us
                for cfg in CANDIDATES:
                    try:
                        us = _time_us(
                            lambda x=x, w=w, cfg=cfg: gemv(
                                x,
                                w,
                                block_n=cfg.block_n,
                                block_k=cfg.block_k,
                                num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages,
                            )
                        )
                    except Exception as e:  # e.g. out of shared memory on this GPU: skip it
                        log.warning("gemv %s does not run for %s: %s", cfg, key, e)
                        continue
                    if us < best_us:
                        best_us, plans[key][m] = us, cfg
                saved[f"{key[0]}x{key[1]}"] = saved.get(f"{key[0]}x{key[1]}", 0.0) + (
                    cublas_us - best_us
                )
        layer.gemv_plan = dict(plans[key])
    for shape, us in saved.items():
        log.info("gemv for %s: %.1f us saved per call over row counts 1-%d", shape, us, MAX_M)
    return saved
