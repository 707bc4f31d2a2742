"""A burst of 2,000 calls at once through a gateway that has 8 Redis connections: admission,
not sockets, bounds what is in flight (the fake backend answers; Redis is real)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import aiohttp
import msgspec
import pytest

from services.gateway.app import bound_port, build_app, start_site
from services.gateway.batcher import Batcher
from services.gateway.state import STATE, GatewaySettings
from shared.bus import close, connect
from shared.messages.common import AbortRequest
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import MODEL

pytestmark = pytest.mark.redis

BURST = 2000
POOL = 8


async def test_a_burst_of_2000_calls_on_8_connections_all_succeeds(
    redis_url: str, redis_sync
) -> None:
    # The fake backend answers each request in its own task: on a bounded pool too.
    backend_client = connect(redis_url, max_connections=POOL)
    backend = FakeBackend(backend_client)
    await backend.start()
    client = connect(redis_url, max_connections=POOL)
    settings = GatewaySettings(
        redis_url=redis_url,
        instance_id=f"gw-{uuid.uuid4().hex[:8]}",
        model_name=MODEL,
        request_timeout_s=60,
    )
    app = await build_app(settings, client)
    runner = await start_site(app, "127.0.0.1", 0, shutdown_timeout=2.0)
    url = f"http://127.0.0.1:{bound_port(runner)}/generate"
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def one() -> int:
                async with http.post(url, json={"text": "length"}) as r:
                    body = await r.json()
                    assert r.status != 200 or body["text"] == "abc", body
                    return r.status

            statuses = Counter(await asyncio.gather(*(one() for _ in range(BURST))))
        assert statuses == {200: BURST}
        batcher = app[STATE].dispatcher.batcher
        # Coalesced: far fewer round trips than requests (each call alone would be one).
        assert batcher.round_trips <= BURST // 10, batcher.round_trips
        assert client.connection_pool.max_connections == POOL
    finally:
        await runner.cleanup()
        await close(client)
        await backend.stop()
        await close(backend_client)


async def test_batched_publications_keep_each_callers_order_and_outcome(
    redis_url: str, redis_sync
) -> None:
    client = connect(redis_url, max_connections=2)
    batcher = Batcher(client)
    try:
        parts = [[("b", AbortRequest(rid=f"{i}-{j}")) for j in range(3)] for i in range(300)]
        await asyncio.gather(*(batcher.publish(p, maxlen=10_000) for p in parts))
        assert batcher.round_trips == 1  # one event-loop turn's callers share a pipeline
        rids = [fields[b"m"] for _, fields in await client.xrange("b")]
        assert len(rids) == 900
        # A caller's own messages stay in its order, and consecutive.
        assert rids == [msgspec.msgpack.encode(m) for p in parts for _, m in p]  # in order
        redis_sync.set("not-a-stream", "x")
        bad = batcher.publish([("not-a-stream", AbortRequest(rid="x"))], maxlen=10)
        good = batcher.publish([("b", AbortRequest(rid="y"))], maxlen=10_000)
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert "WRONGTYPE" in str(results[0]) and results[1] is None  # only its caller fails
    finally:
        await close(client)
