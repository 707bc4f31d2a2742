"""A partition's lease under a busy owner, on a real Redis: it is kept while the event loop is
blocked for longer than its TTL, an owner whose lease merely expired takes it back without a
replay, and an owner that another holder replaced learns it and publishes nothing."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from services.detokenizer.lease import LeaseKeeper, Leases, lease_key
from shared.messages.reply import Delta, Usage

TTL_S = 0.6


def delta(text: str) -> Delta:
    return Delta(
        rid="x", text=text, token_ids=[1], usage=Usage(prompt_tokens=1, completion_tokens=1)
    )


async def test_a_lease_that_expired_with_no_other_taker_is_taken_back(
    aredis: aioredis.Redis,
) -> None:
    owner = Leases(aredis, "owner", 1)
    assert await owner.take_any() == 0
    await aredis.delete(lease_key(0))  # expired while its owner was busy; nobody took it
    assert await owner.commit(0, [("rs:reply:x", delta("a"))], "5-0")
    assert await owner.holder_of(0) == "owner"
    assert 0 < await aredis.pttl(lease_key(0)) <= owner.ttl_ms
    await aredis.delete(lease_key(0))
    assert await owner.extend(0)
    assert await owner.holder_of(0) == "owner"


async def test_an_owner_replaced_meanwhile_cannot_take_it_back(aredis: aioredis.Redis) -> None:
    old, new = Leases(aredis, "old", 1), Leases(aredis, "new", 1)
    assert await old.take_any() == 0
    await aredis.delete(lease_key(0))
    assert await new.take_any() == 0  # a standby took over (and may have answered)
    await aredis.delete(lease_key(0))  # ... and died in turn: the lease is free again
    assert not await old.extend(0)
    assert not await old.commit(0, [("rs:reply:x", delta("stale"))], "9-0")
    assert await aredis.xlen("rs:reply:x") == 0
    assert await old.holder_of(0) is None
    # The same holder taking it anew (after a replay) gets a new epoch and owns it again.
    assert await old.take_any() == 0
    assert await old.commit(0, [("rs:reply:x", delta("fresh"))], "9-0")


async def test_the_keeper_holds_the_lease_while_the_event_loop_is_blocked(
    aredis: aioredis.Redis, redis_url: str
) -> None:
    owner = Leases(aredis, "busy", 1, ttl_s=TTL_S)
    assert await owner.take_any() == 0
    keeper = LeaseKeeper(redis_url, owner, 0, refresh_s=0.1)
    keeper.start()
    try:
        keeper.tick()
        # The loop does synchronous work (a replay, a burst) for 3x the TTL: nothing on the
        # loop can extend the lease meanwhile, only the keeper's thread.
        time.sleep(3 * TTL_S)
        standby = Leases(aredis, "standby", 1, ttl_s=TTL_S)
        assert await standby.take_any() is None
        assert not keeper.lost.is_set()
        assert await owner.holder_of(0) == "busy"
    finally:
        keeper.stop()


async def test_the_keeper_reports_a_lease_taken_by_another(
    aredis: aioredis.Redis, redis_url: str
) -> None:
    old = Leases(aredis, "old", 1, ttl_s=TTL_S)
    assert await old.take_any() == 0
    keeper = LeaseKeeper(redis_url, old, 0, refresh_s=0.05)
    keeper.start()
    try:
        await aredis.delete(lease_key(0))
        new = Leases(aredis, "new", 1, ttl_s=TTL_S)
        assert await new.take_any() == 0
        assert await _wait(keeper.lost.is_set)
        assert await new.holder_of(0) == "new"  # the old keeper took nothing back
    finally:
        keeper.stop()


async def test_a_stuck_loop_lets_the_lease_go(aredis: aioredis.Redis, redis_url: str) -> None:
    owner = Leases(aredis, "stuck", 1, ttl_s=TTL_S)
    assert await owner.take_any() == 0
    keeper = LeaseKeeper(redis_url, owner, 0, refresh_s=0.05, stall_s=0.2)
    keeper.start()
    try:
        standby = Leases(aredis, "standby", 1, ttl_s=TTL_S)

        async def standby_took_it() -> bool:
            return await standby.take_any() == 0

        # No tick: after stall_s the keeper stops extending and the lease runs out.
        assert await _wait(standby_took_it)
        assert not await owner.extend(0)
    finally:
        keeper.stop()


async def _wait(cond: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if await got if inspect.isawaitable(got) else got:
            return True
        await asyncio.sleep(0.02)
    return False
