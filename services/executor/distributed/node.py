"""The executor's group as each process of it sees it: rank 0's handle (`ExecutorGroup`, which
the service's engine runs on) and the other ranks' whole life (`run_rank`): join the group,
load the shard, follow rank 0's steps until it stops."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from services.executor.builder import build_runner, settings_from_flags
from services.executor.distributed.follower import Follower
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.ranks import (
    Layout,
    Watchdog,
    free_addr,
    join,
    start_local_ranks,
)
from services.executor.model_runner import ModelRunner
from shared.model_files import resolve_model

log = logging.getLogger(__name__)

STOP_WAIT_S = 30.0  # for the other ranks to leave their loop after rank 0's stop


def layout_of(a: argparse.Namespace) -> Layout:
    try:
        return Layout(a.tp_size, a.nnodes, a.node_rank, a.base_gpu_id)
    except ValueError as e:
        raise SystemExit(f"radixserve executor: {e}") from None


def init_addr(a: argparse.Namespace) -> str:
    if a.dist_init_addr:
        return str(a.dist_init_addr)
    if a.nnodes > 1:
        raise SystemExit(
            "radixserve executor: --nnodes > 1 needs --dist-init-addr (node 0's host:port, "
            "reachable from every node)"
        )
    return free_addr()


@dataclass
class ExecutorGroup:
    """Rank 0's view of its group (a group of one: nothing to start or stop)."""

    tp: TPGroup = SINGLE
    device: torch.device | None = None
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    watchdog: Watchdog | None = None
    runner: ModelRunner | None = None  # once built: closing stops the others through it
    closed: bool = False

    @classmethod
    def start(cls, a: argparse.Namespace, argv: list[str]) -> ExecutorGroup:
        layout = layout_of(a)
        if layout.tp_size == 1:
            return cls()
        addr = init_addr(a)
        children = start_local_ranks(layout, addr, argv)
        tp, device, watchdog = join(layout, 0, addr, a.device, children)
        log.info("tensor-parallel group of %d ranks gathered at %s", tp.size, addr)
        return cls(tp, device, children, watchdog)

    def close(self) -> None:
        """Stop the other ranks (they leave their loop), wait for this node's."""
        if self.tp.size == 1 or self.closed:
            return
        self.closed = True
        assert self.watchdog is not None
        self.watchdog.stop()
        if self.runner is not None:
            self.runner.stop_followers()
            self.runner.release_graphs()
            # Before waiting for the other ranks to exit: they tear the group down as they
            # leave, and NCCL's teardown waits for every rank's. Waiting for them first would
            # leave them stuck in theirs, then kill them and hang in this rank's.
            destroy_group()
        for child in self.children:
            try:
                child.wait(STOP_WAIT_S if self.runner is not None else 0.1)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if self.runner is None:  # the others never built their loop: gone now, killed
            destroy_group()


def destroy_group() -> None:
    """Tear down the process group. NCCL's ends once every rank runs it, provided no CUDA
    graph that captured collectives is alive (`ModelRunner.release_graphs`). On the calling
    thread: run on a thread of its own, with a timeout, a rank once aborted at exit
    ("terminate called without an active exception") in the two-node test."""
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_rank(
    a: argparse.Namespace,
    layout: Layout,
    rank: int,
    addr: str,
    children: list[subprocess.Popen[bytes]],
) -> int:
    """A rank other than 0, from joining the group to rank 0's stop; the exit status."""
    tp, device, watchdog = join(layout, rank, addr, a.device, children)
    source = resolve_model(a.model, a.served_model_name)
    settings = settings_from_flags(a, source, f"rank-{rank}", "", 0)
    built = build_runner(settings, tp=tp, device=device)
    Follower(built.runner, tp).run()
    watchdog.stop()
    built.runner.release_graphs()
    destroy_group()  # with rank 0's and the others' (see ExecutorGroup.close)
    log.info("rank %d: left the group", rank)
    for child in children:
        child.wait(STOP_WAIT_S)
    return 0


def exit_rank(code: int) -> NoReturn:
    """End a rank's process now that its group is torn down, without the interpreter's
    finalisation: a follower of the two-node test once aborted after rank 0 stopped
    ("terminate called without an active exception", status -6), which is what C++ does
    when a thread object of the collective library is destroyed still running, as at
    finalisation. Logs and standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_follower_node(a: argparse.Namespace, argv: list[str]) -> int:
    """`radixserve executor --node-rank r` (r > 0): this host's ranks of the group."""
    layout = layout_of(a)
    addr = init_addr(a)
    children = start_local_ranks(layout, addr, argv)
    return run_rank(a, layout, layout.ranks()[0], addr, children)
