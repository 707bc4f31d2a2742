"""The bus across a Redis restart (same port, empty server, new run_id) and the supervisor
of a service's workers, against a real redis-server the test restarts."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.bus import FIELD, GroupConsumer, StreamReader, close, connect, publish
from shared.messages.common import AbortRequest
from shared.messages.tokenize import TokenizeMessage
from shared.service import Service
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


def add_with_id(server: RedisServer, stream: str, entry_id: str, rid: str) -> None:
    """XADD with an explicit id, as low as a fresh server allows: below any the old one gave."""
    client = redis.Redis(port=server.port)
    try:
        client.xadd(stream, {FIELD: msgspec.msgpack.encode(AbortRequest(rid=rid))}, id=entry_id)
    finally:
        client.close()


async def test_stream_reader_starts_over_after_a_restart(restartable_redis: RedisServer) -> None:
    r = connect(restartable_redis.url, max_connections=2)
    reader: StreamReader[TokenizeMessage] = StreamReader(r, "s", TokenizeMessage)
    restarted: list[str] = []
    reader.on_restart.append(lambda: restarted.append("restarted"))
    try:
        await reader.start_from_now()
        await publish(r, "s", AbortRequest(rid="before"))
        assert [e.message.rid for e in await reader.read(block_ms=200)] == ["before"]  # type: ignore[union-attr]
        restartable_redis.stop()
        restartable_redis.start()
        # The new server's ids start low again: a reader kept at its old id would skip these.
        add_with_id(restartable_redis, "s", "1-1", "after-1")
        add_with_id(restartable_redis, "s", "1-2", "after-2")
        entries = await asyncio.wait_for(reader.read(block_ms=200), 30)
        assert [e.message.rid for e in entries] == ["after-1", "after-2"]  # type: ignore[union-attr]
        assert restarted == ["restarted"] and reader.restarts == 1
    finally:
        await close(r)


async def test_commands_on_pooled_connections_to_the_old_server_retry(
    restartable_redis: RedisServer,
) -> None:
    """Every pooled connection still points at the server that went away: each one's next
    command fails once on it, and the client's retry reconnects (a gateway's concurrent
    requests after a restart each took one and got a 503)."""
    r = connect(restartable_redis.url, max_connections=4)
    try:
        await asyncio.gather(*(r.ping() for _ in range(4)))
        assert len(r.connection_pool._available_connections) == 4
        restartable_redis.stop()
        restartable_redis.start()
        assert await asyncio.gather(*(r.ping() for _ in range(4))) == [True] * 4
    finally:
        await close(r)


async def test_a_reader_starting_while_redis_is_down_waits_for_it(
    restartable_redis: RedisServer,
) -> None:
    """A service that starts during an outage (the supervisor restarted it just then) waits
    for Redis instead of dying in its start-up."""
    r = connect(restartable_redis.url, max_connections=2)
    reader: StreamReader[TokenizeMessage] = StreamReader(r, "s", TokenizeMessage)
    try:
        restartable_redis.stop()
        starting = asyncio.create_task(reader.start_from_now())
        async with asyncio.timeout(30):
            while reader.backoff.attempt < 2:  # it tried, failed and is waiting to try again
                await asyncio.sleep(0.01)
        assert not starting.done()
        restartable_redis.start()
        await asyncio.wait_for(starting, 30)
        assert reader.last_id == "0-0"  # the new server's (empty) stream's end
        await publish(r, "s", AbortRequest(rid="new"))
        assert [e.message.rid for e in await reader.read(block_ms=200)] == ["new"]  # type: ignore[union-attr]
    finally:
        await close(r)


async def test_group_consumer_recreates_its_group_after_a_restart(
    restartable_redis: RedisServer,
) -> None:
    r = connect(restartable_redis.url, max_connections=2)
    consumer: GroupConsumer[TokenizeMessage] = GroupConsumer(r, "w", "g", "c1", TokenizeMessage)
    restarted: list[str] = []
    consumer.on_restart.append(lambda: restarted.append("restarted"))
    try:
        await consumer.ensure_group()
        await publish(r, "w", AbortRequest(rid="before"))
        assert len(await consumer.read(block_ms=200)) == 1
        restartable_redis.stop()
        restartable_redis.start()
        add_with_id(restartable_redis, "w", "1-1", "after")  # the group is gone with the server
        got: list[str] = []
        async with asyncio.timeout(30):
            while not got:
                got = [e.message.rid for e in await consumer.read(block_ms=200)]  # type: ignore[union-attr]
        assert got == ["after"] and restarted == ["restarted"]
        assert (await r.xinfo_groups("w"))[0]["name"] == b"g"
    finally:
        await close(r)


async def test_supervisor_restarts_a_worker_after_an_outage_only() -> None:
    svc = Service("test", "t1", "redis://127.0.0.1:1/0")  # never connected to
    calls: list[int] = []

    async def flaky() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise RedisConnectionError("Connection refused")

    await asyncio.wait_for(svc.supervise(flaky), 10)
    assert len(calls) == 3  # failed twice with an outage, restarted, then ended

    async def broken() -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):  # anything else takes the service down
        await svc.supervise(broken)

    async def once() -> None:
        raise RedisConnectionError("Connection refused")

    with pytest.raises(RedisConnectionError):  # a bare coroutine cannot be started again
        await svc.supervise(once())
    await close(svc.r)
