"""A StreamReader with trim_consumed: the stream keeps only what it has not read yet, and never
loses an unread entry (the writers' MAXLEN cap used to drop unread replies of a lagging reader)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

import shared.bus
from shared.bus import StreamReader, publish_many
from shared.messages.common import AbortRequest
from shared.messages.tokenize import TokenizeMessage

pytestmark = pytest.mark.redis

N = 3000


async def test_reader_trims_what_it_read_and_nothing_else(
    aredis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared.bus, "TRIM_INTERVAL_S", 0.0)  # trim after every read
    for start in range(0, N, 500):
        await publish_many(
            aredis, [("st", AbortRequest(rid=str(i))) for i in range(start, start + 500)]
        )
    reader: StreamReader[object] = StreamReader(
        aredis, "st", TokenizeMessage, last_id="0-0", trim_consumed=True
    )
    seen: list[str] = []
    lengths: list[int] = []
    while len(seen) < N:
        entries = await reader.read(count=256, block_ms=100)
        assert entries, "the reader ran dry before reading everything: entries were lost"
        seen += [e.message.rid for e in entries]  # type: ignore[attr-defined]
        lengths.append(await aredis.xlen("st"))
        # Approximate trimming frees whole nodes (at most 100 entries each) and never an
        # unread entry: what is left is the unread rest plus at most one node.
        assert N - len(seen) <= lengths[-1] <= N - len(seen) + 100
    assert seen == [str(i) for i in range(N)]
    assert lengths[-1] <= 100


async def test_reader_without_trim_leaves_the_stream(aredis: aioredis.Redis) -> None:
    await publish_many(aredis, [("st2", AbortRequest(rid=str(i))) for i in range(300)])
    reader: StreamReader[object] = StreamReader(aredis, "st2", TokenizeMessage, last_id="0-0")
    assert len(await reader.read(count=300, block_ms=100)) == 300
    assert await aredis.xlen("st2") == 300
