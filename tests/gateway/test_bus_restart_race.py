"""A call registered after Redis restarted, before the gateway's reply reader noticed: it was
published to the new server and is answerable, so the restart must not fail it with the
calls the old server lost. Against a real redis-server the test restarts."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.gateway.admission import Admission
from services.gateway.dispatch import Dispatcher, Pending
from services.gateway.metrics import GatewayMetrics
from services.gateway.replies import ReplyRouter
from services.gateway.validation import Job
from shared.bus import close, connect
from shared.messages.common import SamplingParams
from shared.messages.reply import Failure
from shared.messages.tokenize import TextPrompt
from shared.metrics.registry import ServiceMetrics
from shared.tracing import Tracing
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

WAIT_S = 30.0


def job(rid: str) -> Job:
    return Job(
        prompt=TextPrompt(text="Hello"),
        sampling=SamplingParams(max_new_tokens=4),
        stream=False,
        rid=rid,
    )


async def submit(dispatcher: Dispatcher, rid: str) -> Pending:
    (pending,) = await dispatcher.submit([job(rid)], "")
    return pending


async def test_a_restart_fails_only_the_calls_from_before_it(
    restartable_redis: RedisServer,
) -> None:
    r = connect(restartable_redis.url, max_connections=8)
    router = ReplyRouter(r, "replies:gw-restart")
    metrics = GatewayMetrics(ServiceMetrics("gateway", "m", "", enabled=False))
    dispatcher = Dispatcher(
        r, router, router.stream, 60.0, Admission(100, 0), metrics, Tracing("gateway", "gw")
    )
    try:
        await router.start()
        old = await submit(dispatcher, "old")
        # The reader's loop, held at its first failed read (in production it backs off there,
        # up to 2 s, before it looks at the server again).
        reading = asyncio.create_task(router.reader.read(block_ms=200))
        restartable_redis.stop()
        async with asyncio.timeout(WAIT_S):
            while not router.reader.unconfirmed:
                await asyncio.sleep(0.01)
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        restartable_redis.start()

        new = await submit(dispatcher, "new")
        failure = old.queue.get_nowait()
        assert isinstance(failure, Failure) and failure.error.status == 503
        assert "restarted" in failure.error.message and failure.error.retry_after == 1
        # The reader's own look before its next read finds the restart already handled.
        await router.reader.read(block_ms=50)
        assert router.reader.restarts == 1
        assert new.queue.empty(), new.queue.get_nowait()
    finally:
        await close(r)
