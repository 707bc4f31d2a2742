"""Detokenizer service: owns detokenizer partitions through leases in Redis and turns each one's
tokens (rs:detok:{partition}) into text deltas for the gateways.

`--partition N` pins one partition (waiting for its lease while a previous owner's runs out);
without it the instance takes whichever partition is free, and waits as a standby when every
one is owned. An owner that dies loses its lease within LEASE_TTL_S; the next owner replays the
partition's open requests from the stream (see partition.py) and carries on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from typing import Any

from services.detokenizer import recovery
from services.detokenizer.lease import LeaseKeeper, Leases
from services.detokenizer.metrics import DetokMetrics
from services.detokenizer.partition import Partition, resume_point
from shared import constants
from shared.bus import StreamReader
from shared.config import EnvArgumentParser, add_common_flags, non_negative
from shared.logs import setup_logging
from shared.messages.detok import DetokMessage
from shared.model_files import load_tokenizer, resolve_model
from shared.service import Service, default_instance_id, run_async, service_from_flags

log = logging.getLogger(__name__)

# A standby (or a pinned instance waiting for its partition) looks for a free lease this often.
TAKE_EVERY_S = 0.3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve detokenizer", description=__doc__)
    add_common_flags(p)
    p.add_flag(
        "--partition",
        type=int,
        default=None,
        check=non_negative,
        help="serve only this partition (default: any free one)",
    )
    a = p.parse_args(argv)
    if a.partition is not None and a.partition >= a.detokenizer_partitions:
        p.error(f"--partition={a.partition} must be < --detokenizer-partitions")
    return a


class LeaseLost(Exception):
    pass


# Entries handled per iteration: each is one executor step (up to a few hundred deltas).
READ_COUNT = 256


async def serve_partition(
    svc: Service,
    leases: Leases,
    tokenizer: Any,
    partition: int,
    redis_url: str,
    metrics: DetokMetrics,
) -> None:
    """Own `partition` until the service stops or the lease is lost."""
    stream = constants.detok_stream(partition)
    saved = await svc.r.get(recovery.checkpoint_key(stream))
    rec = recovery.decode(await svc.r.get(recovery.recovery_key(stream)))
    resume = resume_point(saved, rec)
    part = Partition(tokenizer, constants.SCHEDULE_STREAM, resume, rec)
    reader: StreamReader[DetokMessage] = StreamReader(svc.r, stream, DetokMessage)
    reader.last_id = resume.read_after
    svc.watch("detokenize", reader)
    metrics.partitions[partition] = part
    if metrics.tracing.on:
        part.detok.on_finished = metrics.ended
    # Redis restarted empty: the gateways failed every request in flight; the lease is gone
    # too, so the next commit fails and the partition is taken again from scratch.
    reader.on_restart.append(part.detok.forget_all)
    log.info(
        "partition %d taken (checkpoint %s, replaying %d open request(s))",
        partition,
        resume.checkpoint,
        len(rec.open) if rec is not None and resume.replay_until is not None else 0,
    )

    # The lease is extended from a thread: a long replay or burst on this loop cannot lose it.
    keeper = LeaseKeeper(redis_url, leases, partition)
    keeper.start()
    try:
        while not svc.stopping.is_set():
            keeper.tick()
            if keeper.lost.is_set():
                raise LeaseLost
            entries = await reader.read(count=READ_COUNT, block_ms=500)
            was_replaying = part.replaying
            started = time.perf_counter()
            c = part.feed(entries)
            if entries:
                metrics.fed(c.out, time.perf_counter() - started, was_replaying)
            if was_replaying and not part.replaying:
                log.info("partition %d: replayed %d entries", partition, part.replayed)
            committed = not (c.checkpoint or c.out) or await leases.commit(
                partition, c.out, c.checkpoint, c.recovery
            )
            if not committed:
                raise LeaseLost
            if c.low_water:  # a successor starts there now: what is before it can go
                await reader.trim_before(c.low_water)
    finally:
        metrics.partitions.pop(partition, None)
        await asyncio.to_thread(keeper.stop)
        await reader.close()


async def serve(a: argparse.Namespace) -> None:
    source = resolve_model(a.model, a.served_model_name)
    tokenizer = load_tokenizer(source)
    instance = a.instance_id or default_instance_id()
    svc = service_from_flags("detokenizer", a, source.name, instance)
    metrics = DetokMetrics(svc.metrics, svc.tracing)
    leases = Leases(svc.r, instance, a.detokenizer_partitions)

    async def work() -> None:
        while not svc.stopping.is_set():
            partition = await leases.take_any(a.partition)
            if partition is None:  # every partition is owned: stand by
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TAKE_EVERY_S):  # a cancel is kept (3.11)
                        await svc.stopping.wait()
                continue
            try:
                await serve_partition(svc, leases, tokenizer, partition, a.redis_url, metrics)
            except LeaseLost:
                # Another instance owns it now and answers from our last commit on.
                log.warning("partition %d: lease lost; its new owner carries on", partition)
                continue
            finally:
                with contextlib.suppress(Exception):
                    await leases.release(partition)  # a successor need not wait for the TTL

    what = f"partition {a.partition}" if a.partition is not None else "any free partition"
    log.info("detokenizer ready (%s of %d)", what, a.detokenizer_partitions)
    await svc.run(work)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    setup_logging("detokenizer", a.instance_id or default_instance_id(), a.log_level)
    run_async(lambda: serve(a))


if __name__ == "__main__":
    main()
