"""Scheduler service: one active leader reads rs:schedule and routes to executors.

A second instance waits as a standby: leadership is a Redis key with a TTL that the leader
refreshes, so a standby takes over within LEADER_TTL_S of the leader dying, and resumes the
consumer group where the leader left it (unacked entries are claimed again). The routing
table lives in Redis too (routes.py): a new leader rebuilds it, so the requests in flight stay
resumable when an executor is lost later (failover.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from services.scheduler import failover, routes
from services.scheduler.metrics import scheduler_metrics
from services.scheduler.policy import METHODS, Thresholds, make_policy
from services.scheduler.router import Router
from shared import constants
from shared.bus import Entry, GroupConsumer, publish_many
from shared.config import EnvArgumentParser, add_common_flags, non_negative, positive
from shared.logs import setup_logging
from shared.messages.common import AbortRequest
from shared.messages.schedule import FlushCache, RequestDone, ScheduleMessage, TokenizedRequest
from shared.service import (
    default_instance_id,
    live_instances,
    model_label,
    run_async,
    service_from_flags,
)
from shared.tracing import Tracing

log = logging.getLogger(__name__)

LEADER_KEY = constants.SCHEDULER_LEADER_KEY
LEADER_TTL_S = 3.0


def add_flags(p: EnvArgumentParser) -> None:
    """The scheduler's own flags (`radixserve serve` takes them too)."""
    p.add_flag(
        "--resume-wait",
        type=float,
        default=60.0,
        check=positive,
        help="seconds a request resumed from a lost executor waits for another (or the lost "
        "one's restart) before it fails with a retryable 503",
    )
    p.add_flag(
        "--max-queued-requests",
        type=int,
        default=4096,
        check=positive,
        help="requests waiting in executor queues before new ones get 503",
    )
    p.add_flag(
        "--load-balance-method",
        default="cache_aware",
        choices=sorted(METHODS),
        help="how requests are spread over executors: cache_aware (to the executor that was "
        "sent the longest prefix of the prompt, unless the load is imbalanced), least_load, "
        "or round_robin",
    )
    p.add_flag(
        "--cache-threshold",
        type=float,
        default=0.3,
        check=lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]",
        help="cache_aware: the share of a prompt an executor's routed prefixes must match for "
        "the request to follow them (below it: the executor holding the fewest prefix tokens)",
    )
    p.add_flag(
        "--balance-abs-threshold",
        type=int,
        default=64,
        check=non_negative,
        help="cache_aware: the load (requests in flight) is imbalanced when the busiest "
        "executor has more than this many above the idlest, and --balance-rel-threshold "
        "times its load; then the least-loaded executor gets the request",
    )
    p.add_flag(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        check=lambda v: None if v >= 1.0 else "must be at least 1",
        help="cache_aware: see --balance-abs-threshold",
    )
    p.add_flag(
        "--router-tree-tokens",
        type=int,
        default=0,
        check=non_negative,
        help="cache_aware: tokens of routed prefixes remembered per executor, least recently "
        "used forgotten first (0: as many as the executor's KV pool holds)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve scheduler", description=__doc__)
    add_common_flags(p)
    add_flags(p)
    return p.parse_args(argv)


async def serve(a: argparse.Namespace) -> None:
    svc = service_from_flags("scheduler", a, model_label(a))
    thresholds = Thresholds(a.cache_threshold, a.balance_abs_threshold, a.balance_rel_threshold)
    router = Router(
        max_queued=a.max_queued_requests,
        resume_wait_s=a.resume_wait,
        policy=make_policy(a.load_balance_method, thresholds, a.router_tree_tokens),
    )
    # Claim quickly: entries pending at a dead leader should not wait the default 30 s.
    consumer: GroupConsumer[ScheduleMessage] = GroupConsumer(
        svc.r,
        constants.SCHEDULE_STREAM,
        constants.SCHEDULE_GROUP,
        svc.instance,
        ScheduleMessage,
        claim_idle_ms=2000,
        service="scheduler",
    )
    svc.watch("schedule", consumer)
    scheduler_metrics(svc.metrics, router)

    # A few heartbeat intervals: every live executor has beaten again by then.
    consumer.on_restart.append(
        lambda: router.bus_restarted(grace_s=4 * constants.HEARTBEAT_INTERVAL_S + 1.0)
    )

    async def lead() -> bool:
        """Take or keep leadership; True while this instance leads."""
        ttl = int(LEADER_TTL_S * 1000)
        if await svc.r.set(LEADER_KEY, svc.instance, nx=True, px=ttl):
            log.info("became the leader")
            await restore_routes()
            return True
        owner = await svc.r.get(LEADER_KEY)
        if owner is not None and owner.decode() == svc.instance:
            await svc.r.pexpire(LEADER_KEY, ttl)
            return True
        return False

    async def restore_routes() -> None:
        """The table an earlier leader left in Redis: requests in flight stay resumable."""
        n = 0
        async for rid, record in routes.scan(svc.r):
            router.restore(rid, record)
            n += 1
        if n:
            log.info("restored %d route(s) of requests in flight", n)

    async def refresh_gateways() -> None:
        beats = await live_instances(svc.r, "gateway")
        aborts = router.update_gateways([hb.instance for hb in beats])
        if aborts:
            log.warning("a gateway is gone: aborting its %d request(s)", len(aborts))
            await publish_many(svc.r, aborts)

    async def refresh_executors() -> None:
        before = set(router.executors)
        lost = router.update_executors(await live_instances(svc.r, "executor"))
        for name in sorted(set(router.executors) - before):
            log.info("executor %s joined: %d live", name, len(router.executors))
        if not lost:
            return
        rids = [rid for ex in lost for rid in ex.requests]
        for ex in lost:
            why = "stopped beating" if ex.maybe_alive else "is gone"
            level = logging.WARNING if ex.requests else logging.INFO
            log.log(
                level,
                "executor %s %s: resuming its %d request(s)",
                ex.instance,
                why,
                len(ex.requests),
            )
        try:
            records = await routes.load(svc.r, rids)
            drop = failover.streams_to_drop(lost)
            if drop:  # what it had not read is resumed elsewhere; only aborts go there now
                await svc.r.delete(*drop)
            await publish_many(svc.r, failover.reroutes(lost, records))
        except BaseException:
            router.unlose(lost)  # found lost again at the next look, and resumed then
            raise

    async def work() -> None:
        await consumer.ensure_group()
        last_refresh = last_lead = 0.0
        leading = False
        while not svc.stopping.is_set():
            now = time.monotonic()
            if now - last_lead > LEADER_TTL_S / 3:
                last_lead = now
                leading = await lead()
            if not leading:
                await asyncio.sleep(0.5)
                continue
            if now - last_refresh > 0.2:
                last_refresh = now
                await refresh_executors()
                await refresh_gateways()
                router.expire()
            entries = await consumer.read(count=256, block_ms=100)
            read_at = time.time()
            if entries and not router.executors:
                await refresh_executors()  # one may have started since the last look
            out = router.unpark()  # resumed requests waiting for an executor that came back
            for e in entries:
                msg = e.message
                if isinstance(msg, TokenizedRequest):
                    out += router.route(msg)
                elif isinstance(msg, AbortRequest):
                    out += router.abort(msg)
                elif isinstance(msg, RequestDone):
                    router.done(msg.rid)
                elif isinstance(msg, FlushCache):
                    out += router.flush_cache(msg)
            saves, deletes = router.take_changes()
            # the routed requests, their stored routes and the ack of what led to them: one
            # round trip, atomically; if it fails, none of it happened (the entries come again)
            try:
                await consumer.commit(
                    out,
                    [e.id for e in entries],
                    maxlen=constants.INSTANCE_STREAM_MAXLEN,
                    extra=routes.staged(saves, deletes),
                )
            except BaseException:
                router.commit_failed()
                raise
            router.committed()
            if svc.tracing.on:
                trace_routes(svc.tracing, router, entries, read_at)
        if leading:  # hand over at once rather than after the TTL
            owner = await svc.r.get(LEADER_KEY)
            if owner is not None and owner.decode() == svc.instance:
                await svc.r.delete(LEADER_KEY)

    log.info("scheduler ready (load balance method %s)", a.load_balance_method)
    await svc.run(work)


def trace_routes(
    tracing: Tracing, router: Router, entries: list[Entry[ScheduleMessage]], read_at: float
) -> None:
    """A `route` span per request of the batch, from its read to its commit."""
    now = time.time()
    for e in entries:
        msg = e.message
        if isinstance(msg, TokenizedRequest):
            routed = router.assigned.get(msg.trace.rid)
            tracing.record(
                "route",
                msg.trace.traceparent,
                read_at,
                now,
                {
                    "rid": msg.trace.rid,
                    "executor": routed.executor if routed is not None else "",
                    "resumes": msg.resumes,
                },
            )


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    setup_logging("scheduler", a.instance_id or default_instance_id(), a.log_level)
    run_async(lambda: serve(a))


if __name__ == "__main__":
    main()
