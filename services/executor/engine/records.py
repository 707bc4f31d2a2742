"""The records one step leaves behind, each written once by its one owner.

    forward = runner.forward(plan, prev)           # Forward: the plan, its sampling rows, logits
    sampled = sampler.sample(forward, positions)   # Sampled: tokens on device and host, logprobs
    InFlight(forward, indices, sampled)            # the engine's step in flight

A step whose sampling is deferred (a grammar mask needs the previous step's tokens first)
is in flight with `sampled = None` until the engine samples it; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.executor.batch_policy import StepPlan
    from services.executor.sampling.logprobs import SampledLogprobs


@dataclass(frozen=True)
class Forward:
    """A forward pass queued on the device."""

    plan: StepPlan
    rows: list[int]  # plan indices of the requests that sample this step
    logits: torch.Tensor  # [len(plan.reqs), vocab]: each request's last new token's
    # an extend run as decode rows replayed from the CUDA graphs (extend_rows.py)
    as_rows: bool = False


@dataclass(frozen=True)
class Sampled:
    """A step's sampled tokens, one per sampling row, queued on the device."""

    tokens: torch.Tensor  # [rows] int64 on the device (the next step may read them there)
    host: torch.Tensor  # [rows] int64 on the host, filled by an async copy
    done: torch.cuda.Event | None  # the copy's event; None on the CPU (synchronous)
    logprobs: SampledLogprobs | None = None  # of the rows that asked

    def wait(self) -> list[int]:
        """The tokens on the host (blocks until the device has them)."""
        if self.done is not None:
            self.done.synchronize()
        return [int(t) for t in self.host.tolist()]


@dataclass(frozen=True)
class InFlight:
    """The engine's launched step: what it computes, where each sampled token goes in its
    request's output, and its sampling (None while deferred)."""

    forward: Forward
    indices: list[int]  # output index of each sampling row's token
    sampled: Sampled | None

    @property
    def plan(self) -> StepPlan:
        return self.forward.plan

    @property
    def rows(self) -> list[int]:
        return self.forward.rows

    @property
    def deferred(self) -> bool:
        return self.sampled is None and bool(self.forward.rows)

    def with_sampled(self, sampled: Sampled) -> InFlight:
        return replace(self, sampled=sampled)


def no_tokens(device: torch.device) -> Sampled:
    """The sampling of a step in which no request samples (prompt chunks only)."""
    empty = torch.empty(0, dtype=torch.int64)
    return Sampled(empty.to(device), empty, None)
