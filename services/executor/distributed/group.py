"""The tensor-parallel group of one executor: its rank, its size, and the collectives the
model and the step loop use. A group of one does no communication at all, so TP=1 runs the
same code as before the group existed.

Collectives go through torch.distributed: NCCL between GPUs, gloo on the CPU (CI tests TP=2 as
two processes). Every rank must make the same collective calls in the same order: the model's
(one all-reduce per row-parallel projection, an all-reduce for the embedding, an all-gather
for the logits) and the step loop's (the step tables and the sampled tokens, broadcast from
rank 0: steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None when size is 1)
    host_group: Any = None  # a gloo group over the same ranks, for host-side data

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that reads and writes the bus, plans and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension (rank order)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one NCCL call into one buffer (and CUDA-graph capturable)
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = list(out.unbind(0))
        else:  # gloo gathers into a list
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (the ranks agree on a KV pool size)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def shard(self, n: int, what: str) -> int:
        """n split evenly over the ranks; ValueError naming `what` when it does not divide."""
        if n % self.size:
            raise ValueError(
                f"--tp-size {self.size} must divide the model's {what} ({n}): choose a tp "
                "size that divides it"
            )
        return n // self.size


SINGLE = TPGroup()


def init_group(
    rank: int, size: int, init_addr: str, device: torch.device, timeout_s: float = 600.0
) -> TPGroup:
    """Join the group of `size` ranks whose rank 0 listens at `init_addr` (host:port): NCCL
    on CUDA, gloo on the CPU."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        world_size=size,
        rank=rank,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    host = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    return TPGroup(rank, size, dist.group.WORLD, host)
