"""Operator endpoints: POST /flush_cache."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.responses import json_response
from services.gateway.state import STATE
from shared import constants
from shared.bus import publish
from shared.messages.heartbeat import Heartbeat
from shared.messages.schedule import FlushCache
from shared.service import live_instances

FLUSH_WAIT_S = 5.0  # a few heartbeats: long enough for every executor to report the flush


async def _executors(request: web.Request) -> list[Heartbeat]:
    beats = await live_instances(request.app[STATE].r, "executor")
    return [b for b in beats if b.executor is not None]


async def flush_cache(request: web.Request) -> web.StreamResponse:
    """Empty every executor's prefix cache. Refused while requests are queued or running:
    they hold parts of the cache. Answers once every executor reports an empty cache."""
    state = request.app[STATE]
    asked = time.time()
    beats = await _executors(request)
    if not beats:
        raise ApiError(503, "no executor is alive", type="service_unavailable")
    if _busy(beats):
        # A beat is up to one interval old: requests that finished since may still count.
        # Judge by beats sent after this request arrived.
        beats = await _fresh_beats(request, asked)
    busy = _busy(beats)
    if busy:
        raise ApiError(400, f"cannot flush the cache while {busy} request(s) are queued or running")
    sent = time.time()
    await publish(state.r, constants.SCHEDULE_STREAM, FlushCache(), constants.WORK_STREAM_MAXLEN)
    deadline = time.monotonic() + FLUSH_WAIT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        beats = await _executors(request)
        fresh = [b for b in beats if b.ts > sent and b.executor is not None]
        if len(fresh) == len(beats) and all(
            b.executor is not None and b.executor.cached_tokens == 0 for b in fresh
        ):
            return json_response({"message": "Cache flushed.", "executors": len(beats)})
    raise ApiError(
        409,
        "the flush was refused: requests arrived while it was under way; retry",
        type="conflict",
    )


def _busy(beats: list[Heartbeat]) -> int:
    return sum(b.executor.waiting + b.executor.running for b in beats if b.executor)


async def _fresh_beats(request: web.Request, since: float) -> list[Heartbeat]:
    deadline = time.monotonic() + FLUSH_WAIT_S
    beats = await _executors(request)
    while time.monotonic() < deadline and not all(b.ts > since for b in beats):
        await asyncio.sleep(0.05)
        beats = await _executors(request)
    return beats


def add_routes(app: web.Application) -> None:
    app.router.add_post("/flush_cache", flush_cache)
