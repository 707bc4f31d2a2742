"""A step's tables: every integer the forward pass needs, planned by rank 0 and sent to the
other ranks, which run the same kernels on them.

Rank 0 alone plans (the batch policy, the prefix cache, the KV slots) and samples. Each step it
sends `StepTables` on the group's host channel (gloo: the tables are host lists, and sending
them never waits on the device, so every rank queues the step while the previous one runs);
the step's sampled tokens go on the device channel (`TPGroup.broadcast`), and stay on the
device, where the next step reads its pending inputs. The tables travel as one int64 tensor
behind a fixed header: no pickling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# [kind, is_decode, sampling rows, as_rows, then the length of each list field, in FIELDS order]
FIELDS = (
    "ids",
    "positions",
    "slots",
    "rows",
    "seq_lens",
    "last",
    "prefix_lens",
    "extend_lens",
    "pending_at",
    "pending_src",
    "extra",
    "write_sizes",
    "write_rows",
    "write_cols",
    "write_vals",
)
HEADER = 4 + len(FIELDS)


class Kind(enum.IntEnum):
    STEP = 1
    STOP = 2  # rank 0 is stopping: the others leave their loop


@dataclass
class StepTables:
    """One step as every rank runs it (model_runner.py builds the ForwardBatch from it).

    Lists are per token (ids, positions, slots), per request (rows, seq_lens, last,
    prefix_lens, extend_lens), per pending input (pending_at: its token index; pending_src:
    its row in the previous step's sampled tokens), per prompt-logprob position (extra), and
    the request table's writes since the last step, flush by flush (write_sizes).
    """

    is_decode: bool
    sampling_rows: int  # tokens this step samples: their broadcast follows the forward pass
    as_rows: bool = False  # an extend run as decode rows, one a token (extend_rows.py)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    pending_at: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    extra: list[int] = field(default_factory=list)
    write_sizes: list[int] = field(default_factory=list)
    write_rows: list[int] = field(default_factory=list)
    write_cols: list[int] = field(default_factory=list)
    write_vals: list[int] = field(default_factory=list)

    def add_writes(self, log: list[tuple[list[int], list[int], list[int]]]) -> None:
        for rows, cols, vals in log:
            self.write_sizes.append(len(rows))
            self.write_rows += rows
            self.write_cols += cols
            self.write_vals += vals

    def writes(self) -> list[tuple[list[int], list[int], list[int]]]:
        """The request table's writes, flush by flush, in order."""
        out, at = [], 0
        for n in self.write_sizes:
            end = at + n
            out.append((self.write_rows[at:end], self.write_cols[at:end], self.write_vals[at:end]))
            at = end
        return out

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        lists = [getattr(self, name) for name in FIELDS]
        header = [int(Kind.STEP), int(self.is_decode), self.sampling_rows, int(self.as_rows)]
        header += map(len, lists)
        flat = [v for values in lists for v in values]
        return torch.tensor(header, dtype=torch.int64), torch.tensor(flat, dtype=torch.int64)

    @classmethod
    def decode(cls, header: list[int], payload: list[int]) -> StepTables:
        out = cls(is_decode=bool(header[1]), sampling_rows=header[2], as_rows=bool(header[3]))
        at = 0
        for name, n in zip(FIELDS, header[4:], strict=True):
            setattr(out, name, payload[at : at + n])
            at += n
        return out


class HostChannel:
    """Rank 0's step tables to every rank, over a gloo group (host memory)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, tables: StepTables) -> None:
        header, payload = tables.encode()
        dist.broadcast(header, src=0, group=self.group)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.group)

    def send_stop(self) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = int(Kind.STOP)
        dist.broadcast(header, src=0, group=self.group)

    def receive(self) -> StepTables | None:
        """The next step's tables; None when rank 0 stops."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        h = header.tolist()
        if h[0] == Kind.STOP:
            return None
        payload = torch.zeros(sum(h[4:]), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.group)
        return StepTables.decode(h, payload.tolist())
