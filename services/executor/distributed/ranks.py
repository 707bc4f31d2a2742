"""Starting and watching the ranks of one executor group.

`radixserve executor --tp-size N` on node 0 is rank 0: it serves the bus and starts the other
ranks of its node as child processes (`python -m services.executor.distributed.rank`, with
the same flags); with `--nnodes M`, the same command with `--node-rank r` on node r starts
that node's ranks, all followers. Ranks are numbered node by node; the local rank l of a node
uses GPU `--base-gpu-id + l`. Every rank joins the group at `--dist-init-addr` (rank 0's
host:port; chosen by rank 0 on a single node).

A group lives or dies whole, since a collective with a dead rank never completes: every rank
runs a watchdog. Rank 0's sees its children exit and the other nodes' ranks stop beating (a
counter each writes into the group's store every second); the others' see rank 0's store go
away. Either way the process exits at once with a non-zero status, and the supervisor
(`radixserve serve`, compose) restarts the group; the scheduler resumes its requests elsewhere
meanwhile (or fails them with a retryable 503 when nowhere else can take them).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.executor.distributed.group import TPGroup, init_group

log = logging.getLogger(__name__)

BEAT_S = 1.0  # how often every rank writes its counter into the group's store
LOST_AFTER_S = 15.0  # a rank whose counter has not moved for this long is gone
EXIT_LOST = 3  # the exit status of a rank that saw its group break


@dataclass(frozen=True)
class Layout:
    tp_size: int
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(
                f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes})")

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    def ranks(self) -> range:
        """The global ranks of this node."""
        first = self.node_rank * self.per_node
        return range(first, first + self.per_node)

    def device(self, rank: int, requested: str) -> torch.device:
        """Rank `rank`'s device: the requested one's kind, GPU base + its local rank."""
        kind = "cpu" if requested == "cpu" or not torch.cuda.is_available() else "cuda"
        if requested.startswith("cuda:"):  # --device cuda:N is the first GPU of the group
            base = int(requested.split(":", 1)[1])
        else:
            base = self.base_gpu_id
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(f"cuda:{base + rank - self.ranks()[0]}")


def free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_local_ranks(
    layout: Layout, init_addr: str, argv: list[str]
) -> list[subprocess.Popen[bytes]]:
    """The ranks of this node after its first, as child processes running the same flags."""
    procs = []
    for rank in layout.ranks()[1:]:
        cmd = [
            sys.executable,
            "-m",
            "services.executor.distributed.rank",
            *argv,
            "--tp-rank",
            str(rank),
            "--dist-init-addr",
            init_addr,
        ]
        # Its own session: a Ctrl-C meant for the service reaches rank 0 alone, which stops
        # the others in step (a STOP after their last step), not mid-collective.
        procs.append(subprocess.Popen(cmd, start_new_session=True))
    return procs


def join(
    layout: Layout,
    rank: int,
    init_addr: str,
    requested_device: str,
    children: list[subprocess.Popen[bytes]],
) -> tuple[TPGroup, torch.device, Watchdog]:
    """Join the group as `rank` on its device, watched from then on (with this node's
    `children`, the ranks this process started)."""
    device = layout.device(rank, requested_device)
    if device.type == "cpu":
        # The node's ranks share its cores: each with all of them, their spinning thread pools
        # starve one another and every collective waits on a descheduled rank.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.per_node))
    tp = init_group(rank, layout.tp_size, init_addr, device)
    watchdog = Watchdog(tp, init_addr, children)
    watchdog.start()
    return tp, device, watchdog


class Watchdog:
    """A daemon thread that ends this process the moment its group is broken."""

    def __init__(
        self,
        tp: TPGroup,
        init_addr: str,
        children: list[subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.tp, self.children = tp, children or []
        host, port = init_addr.rsplit(":", 1)
        # A client of the group's store (rank 0's process holds it): a rank whose store is
        # gone lost rank 0.
        self.store = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=LOST_AFTER_S)
        )
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tp-watchdog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """The group is being shut down on purpose: stop watching."""
        self.stopped.set()

    def _run(self) -> None:
        beat = 0
        last_seen: dict[int, tuple[str, float]] = {}
        while not self.stopped.wait(BEAT_S):
            try:
                beat += 1
                self.store.set(f"tp/beat/{self.tp.rank}", str(beat))
                if self.tp.is_leader:
                    self._check_others(last_seen)
            except Exception as e:  # the store (rank 0) is gone, or a rank stopped beating
                if self.stopped.is_set():
                    return
                self._lost(f"{e}")
            for child in self.children:
                if child.poll() is not None and not self.stopped.is_set():
                    self._lost(f"rank process {child.pid} exited with {child.returncode}")

    def _check_others(self, last_seen: dict[int, tuple[str, float]]) -> None:
        now = time.monotonic()
        for rank in range(1, self.tp.size):
            key = f"tp/beat/{rank}"
            value = self.store.get(key).decode() if self.store.check([key]) else ""
            seen, since = last_seen.get(rank, ("", now))
            if value != seen:
                last_seen[rank] = (value, now)
            elif now - since > LOST_AFTER_S:
                raise RuntimeError(f"rank {rank} has not beaten for {now - since:.0f}s")

    def _lost(self, why: str) -> None:
        log.error("tensor-parallel rank %d: the group is broken (%s); exiting", self.tp.rank, why)
        logging.shutdown()
        os._exit(EXIT_LOST)
