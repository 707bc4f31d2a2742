"""Bus semantics against a real Redis: ack, redelivery to another consumer, trimming."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis.asyncio as aioredis

from shared import constants
from shared.bus import FIELD, GroupConsumer, StreamReader, publish, publish_many
from shared.messages.common import AbortRequest
from shared.messages.tokenize import TokenizeMessage

pytestmark = pytest.mark.redis


def consumer(r: aioredis.Redis, name: str, idle_ms: int = 60_000) -> GroupConsumer[object]:
    return GroupConsumer(r, "s", "g", name, TokenizeMessage, claim_idle_ms=idle_ms)


async def test_ack_removes_from_pending(aredis: aioredis.Redis) -> None:
    c = consumer(aredis, "c1")
    await c.ensure_group()
    await publish(aredis, "s", AbortRequest(rid="a"))
    entries = await c.read(block_ms=100)
    assert [e.message for e in entries] == [AbortRequest(rid="a")]
    assert (await aredis.xpending("s", "g"))["pending"] == 1
    await c.ack([e.id for e in entries])
    assert (await aredis.xpending("s", "g"))["pending"] == 0
    assert await c.read(block_ms=50) == []


async def test_unacked_entry_is_redelivered_to_another_consumer(aredis: aioredis.Redis) -> None:
    dead = consumer(aredis, "dead")
    await dead.ensure_group()
    await publish(aredis, "s", AbortRequest(rid="lost?"))
    taken = await dead.read(block_ms=100)
    assert len(taken) == 1  # read, then the consumer "crashes" without acking
    alive = consumer(aredis, "alive", idle_ms=50)
    alive._last_claim = 0.0
    await asyncio.sleep(0.1)
    claimed = await alive.read(block_ms=100)
    assert [e.message for e in claimed] == [AbortRequest(rid="lost?")]
    assert claimed[0].id == taken[0].id
    pending = await aredis.xpending_range("s", "g", "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"alive"]
    await alive.ack([claimed[0].id])
    assert (await aredis.xpending("s", "g"))["pending"] == 0


async def test_fresh_entries_are_not_stolen_before_idle(aredis: aioredis.Redis) -> None:
    a, b = consumer(aredis, "a"), consumer(aredis, "b")
    await a.ensure_group()
    await publish(aredis, "s", AbortRequest(rid="x"))
    assert len(await a.read(block_ms=100)) == 1
    assert await b.read(block_ms=50) == []


async def test_a_dead_consumers_entries_are_taken_at_once_a_live_ones_never(
    aredis: aioredis.Redis,
) -> None:
    """Given the consumers' service, entries of a consumer whose liveness key is gone move to
    the next reader at once (the claim_idle_ms here is a minute); a live one keeps its own."""

    def worker(name: str) -> GroupConsumer[object]:
        return GroupConsumer(
            aredis, "s", "g", name, TokenizeMessage, claim_idle_ms=60_000, service="tok"
        )

    busy, gone, taker = worker("busy"), worker("gone"), worker("taker")
    await busy.ensure_group()
    for name, w in (("busy", busy), ("gone", gone)):
        await aredis.set(constants.live_key("tok", name), b"beat")
        await publish(aredis, "s", AbortRequest(rid=name))
        assert len(await w.read(count=1, block_ms=100)) == 1  # read, never acked
    assert await taker.read(block_ms=50) == []  # both alive: nothing moves
    await aredis.delete(constants.live_key("tok", "gone"))  # as the supervisor does at exit
    taker._last_dead_check = 0.0  # the next read looks (it does so once a second)
    claimed = await taker.read(block_ms=50)
    assert [e.message for e in claimed] == [AbortRequest(rid="gone")]
    owners = {p["consumer"] for p in await aredis.xpending_range("s", "g", "-", "+", 10)}
    assert owners == {b"busy", b"taker"}


async def test_trimming_bounds_the_stream(aredis: aioredis.Redis) -> None:
    for i in range(3000):
        await publish(aredis, "t", AbortRequest(rid=str(i)), maxlen=100)
    n = await aredis.xlen("t")
    # MAXLEN ~ trims whole macro nodes: near the bound, never unbounded.
    assert 100 <= n < 400


async def test_undecodable_entry_is_dropped_and_acked(aredis: aioredis.Redis) -> None:
    c = consumer(aredis, "c")
    await c.ensure_group()
    await aredis.xadd("s", {FIELD: b"\xc1garbage"})
    await publish(aredis, "s", AbortRequest(rid="ok"))
    entries = await c.read(block_ms=100)
    assert [e.message for e in entries] == [AbortRequest(rid="ok")]
    assert (await aredis.xpending("s", "g"))["pending"] == 1  # only the good one waits for ack


async def test_group_is_recreated_after_redis_loses_it(aredis: aioredis.Redis) -> None:
    c = consumer(aredis, "c")
    await c.ensure_group()
    await aredis.flushall()  # what a Redis restart without persistence looks like
    await publish(aredis, "s", AbortRequest(rid="after"))
    entries = await c.read(block_ms=100)
    # The group is re-created at "0": the entry written after the loss is still delivered.
    if not entries:
        entries = await c.read(block_ms=100)
    assert [e.message for e in entries] == [AbortRequest(rid="after")]


async def test_group_read_survives_the_stream_vanishing_while_blocked(
    aredis: aioredis.Redis, redis_url: str
) -> None:
    """Redis 7 answers a blocked XREADGROUP with UNBLOCKED when its stream is deleted."""
    c = consumer(aredis, "c")
    await c.ensure_group()
    blocked = asyncio.create_task(c.read(block_ms=2000))
    await asyncio.sleep(0.2)
    other = aioredis.from_url(redis_url)
    await other.delete("s")
    await other.aclose()
    await publish(aredis, "s", AbortRequest(rid="after"))
    entries = await asyncio.wait_for(blocked, 5)
    if not entries:
        entries = await c.read(block_ms=100)
    assert [e.message for e in entries] == [AbortRequest(rid="after")]


async def test_stream_reader_sees_entries_in_order(aredis: aioredis.Redis) -> None:
    await publish(aredis, "one", AbortRequest(rid="before"))
    reader: StreamReader[object] = StreamReader(aredis, "one", TokenizeMessage)
    await reader.start_from_now()
    await publish_many(aredis, [("one", AbortRequest(rid=str(i))) for i in range(5)])
    got = await reader.read(block_ms=100)
    assert [e.message.rid for e in got] == ["0", "1", "2", "3", "4"]  # type: ignore[attr-defined]


async def test_checkpoint_is_written_with_the_messages(aredis: aioredis.Redis) -> None:
    await publish_many(aredis, [("out", AbortRequest(rid="x"))], checkpoint=("pos", b"7-0"))
    assert await aredis.get("pos") == b"7-0"
    raw = await aredis.xrange("out")
    assert msgspec.msgpack.decode(raw[0][1][FIELD])["rid"] == "x"


async def test_commit_publishes_and_acks_in_one_round_trip(
    aredis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A work-queue service (tokenizer, grammar, scheduler) hands on what a batch led to and
    acks the batch together: one MULTI, not a publish then an ack before its next read."""
    c = consumer(aredis, "c1")
    await c.ensure_group()
    await publish_many(aredis, [("s", AbortRequest(rid=str(i))) for i in range(3)])
    entries = await c.read(block_ms=100)
    trips: list[str] = []
    single = aredis.execute_command
    pipeline = aredis.pipeline

    async def one_command(*args: object, **kw: object) -> object:
        trips.append(f"command {args[0]}")
        return await single(*args, **kw)

    def counted_pipeline(transaction: bool = True, shard_hint: object = None) -> object:
        pipe = pipeline(transaction=transaction, shard_hint=shard_hint)
        execute = pipe.execute

        async def run(*a: object, **kw: object) -> object:
            trips.append(f"pipeline transaction={transaction} of {len(pipe)}")
            return await execute(*a, **kw)

        pipe.execute = run
        return pipe

    monkeypatch.setattr(aredis, "execute_command", one_command)
    monkeypatch.setattr(aredis, "pipeline", counted_pipeline)
    await c.commit([("out", AbortRequest(rid="x"))], [e.id for e in entries], maxlen=100)
    assert trips == ["pipeline transaction=True of 2"]  # XADD + XACK in one MULTI
    trips.clear()
    await c.commit([], [], maxlen=100)  # nothing consumed, nothing to say: no round trip
    assert trips == []
    monkeypatch.undo()
    assert (await aredis.xpending("s", "g"))["pending"] == 0
    assert len(await aredis.xrange("out")) == 1
