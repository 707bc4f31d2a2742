"""Operator endpoints: POST /flush_cache."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.responses import json_response
from services.gateway.state import STATE, GatewayState
from shared import constants
from shared.bus import publish
from shared.messages.heartbeat import Heartbeat
from shared.messages.schedule import FlushCache
from shared.service import live_instances

FLUSH_WAIT_S = 5.0  # a few heartbeats: long enough for every executor to report the flush


async def _executors(state: GatewayState) -> list[Heartbeat]:
    beats = await live_instances(state.r, "executor")
    return [b for b in beats if b.executor is not None]


async def flush_cache(request: web.Request) -> web.StreamResponse:
    executors = await flush_all(request.app[STATE])
    return json_response({"message": "Cache flushed.", "executors": executors})


async def flush_all(state: GatewayState, idle_wait_s: float = 0.0) -> int:
    """Empty every executor's prefix cache (HTTP and gRPC alike): how many there are. Refused
    while requests are queued or running, they hold parts of the cache, unless they end
    within `idle_wait_s`. Returns once every executor reports an empty cache."""
    asked = time.time()
    beats = await _executors(state)
    if not beats:
        raise ApiError(503, "no executor is alive", type="service_unavailable")
    if _busy(beats):
        # A beat is up to one interval old: requests that finished since may still count.
        # Judge by beats sent after this request arrived.
        beats = await _fresh_beats(state, asked, idle_wait_s)
    busy = _busy(beats)
    if busy:
        raise ApiError(400, f"cannot flush the cache while {busy} request(s) are queued or running")
    sent = time.time()
    await publish(state.r, constants.SCHEDULE_STREAM, FlushCache(), constants.WORK_STREAM_MAXLEN)
    deadline = time.monotonic() + FLUSH_WAIT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        beats = await _executors(state)
        fresh = [b for b in beats if b.ts > sent and b.executor is not None]
        if len(fresh) == len(beats) and all(
            b.executor is not None and b.executor.cached_tokens == 0 for b in fresh
        ):
            return len(beats)
    raise ApiError(
        409,
        "the flush was refused: requests arrived while it was under way; retry",
        type="conflict",
    )


def _busy(beats: list[Heartbeat]) -> int:
    return sum(b.executor.waiting + b.executor.running for b in beats if b.executor)


async def _fresh_beats(state: GatewayState, since: float, idle_wait_s: float) -> list[Heartbeat]:
    """Beats sent after `since`; then, for up to `idle_wait_s`, until they show no requests."""
    deadline = time.monotonic() + FLUSH_WAIT_S
    beats = await _executors(state)
    while time.monotonic() < deadline and not all(b.ts > since for b in beats):
        await asyncio.sleep(0.05)
        beats = await _executors(state)
    deadline = time.monotonic() + idle_wait_s
    while time.monotonic() < deadline and _busy(beats):
        await asyncio.sleep(0.1)
        beats = await _executors(state)
    return beats


def add_routes(app: web.Application) -> None:
    app.router.add_post("/flush_cache", flush_cache)
