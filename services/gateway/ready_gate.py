"""Reading readiness from Redis, and refusing API requests at once until the stack is first
ready (503 with Retry-After) instead of queueing them behind a model that is still loading.

Only the first readiness gates: once the stack has served, a stage that restarts leaves
requests waiting in its stream (its replacement picks them up), which beats failing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.readiness import Readiness, assess
from services.gateway.state import STATE, GatewayState
from shared import constants
from shared.bus import TRANSIENT
from shared.messages.heartbeat import Heartbeat

log = logging.getLogger(__name__)

POLL_S = 0.25
RETRY_AFTER_S = 2.0
# Routes that answer for themselves: stopping requests, the probe, the executors' cache.
UNGATED = frozenset({"/abort_request", "/abort_all", "/health_generate", "/flush_cache"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_decoder = msgspec.msgpack.Decoder(Heartbeat)


async def read_readiness(r: aioredis.Redis, partitions: int = 0) -> Readiness:
    """From the heartbeats, the scheduler's leadership and the owners (leases) of the first
    `partitions` detokenizer partitions."""
    keys = [k async for k in r.scan_iter(match=f"{constants.LIVE_PREFIX}:*", count=500)]
    values = await r.mget(keys) if keys else []
    leader = await r.get(constants.SCHEDULER_LEADER_KEY)
    owners = (
        await r.mget([constants.detok_lease_key(p) for p in range(partitions)])
        if partitions
        else []
    )
    beats = [_decoder.decode(v) for v in values if v is not None]
    holders = [o.decode() if o is not None else None for o in owners]
    return assess(beats, leader.decode() if leader else None, time.time(), detok_owners=holders)


async def watch_until_ready(app: web.Application) -> None:
    """Poll readiness until the stack is first ready, then open the gate."""
    state = app[STATE]
    while True:
        try:
            state.readiness = await read_readiness(state.r, state.settings.detokenizer_partitions)
            if state.readiness.ready:
                state.ready.set()
                return
        except TRANSIENT as e:
            log.warning("cannot read readiness: %s", e)
        await asyncio.sleep(POLL_S)


async def readiness_ctx(app: web.Application) -> AsyncIterator[None]:
    """The watcher's lifetime, with the app's; without `wait_until_ready` the gate is open."""
    state = app[STATE]
    if not state.settings.wait_until_ready:
        state.ready.set()
        yield
        return
    watcher = asyncio.create_task(watch_until_ready(app), name="readiness")
    yield
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher


@web.middleware
async def until_ready(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if not (state.ready.is_set() or request.method != "POST" or request.path in UNGATED):
        await check_ready(state)
    return await handler(request)


async def check_ready(state: GatewayState) -> None:
    """Raise 503 with Retry-After until the stack is first ready (HTTP and gRPC alike)."""
    if state.ready.is_set():
        return
    # Read it now rather than trust the watcher's last look: a client that saw /health say
    # 200 must not get a 503 here.
    try:
        state.readiness = await read_readiness(state.r, state.settings.detokenizer_partitions)
    except TRANSIENT as e:
        raise ApiError(503, f"cannot reach the request bus: {e}", retry_after=RETRY_AFTER_S) from e
    if state.readiness.ready:
        state.ready.set()
        return
    waiting = state.readiness.message()
    raise ApiError(503, f"the server is starting ({waiting})", retry_after=RETRY_AFTER_S)
