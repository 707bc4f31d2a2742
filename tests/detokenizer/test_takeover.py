"""A partition changing owner mid-stream, on a real Redis: the new owner replays from the
low-water mark, answers exactly what the old one had not, and nothing reaches a gateway twice."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from services.detokenizer import recovery
from services.detokenizer.lease import Leases, lease_key
from services.detokenizer.partition import Partition, resume_point
from shared import constants
from shared.bus import FIELD, Entry, publish
from shared.messages.common import SamplingParams, Trace
from shared.messages.detok import DetokMessage, DetokRegister, StepOutput, TokenDelta
from shared.messages.reply import Delta, Failure, ReplyMessage, Usage
from tests.executor.helpers import make_tokenizer

STREAM = constants.detok_stream(0)
DECODE = msgspec.msgpack.Decoder(DetokMessage)
REPLY = msgspec.msgpack.Decoder(ReplyMessage)


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


def register(rid: str, **sp: object) -> DetokRegister:
    return DetokRegister(
        trace=Trace(rid=rid, reply_to=f"rs:reply:{rid}", deadline=1e12),
        prompt_tokens=3,
        sampling=SamplingParams(**sp),  # type: ignore[arg-type]
    )


def script(tok: Any) -> list[DetokMessage]:
    """Three requests interleaved token by token: one ends by a stop string, one by length,
    one is still open at the end (its registration is the low-water mark throughout)."""
    texts = {"a": "the thin thing in the", "b": "héllo 世界 ok", "c": "open forever 🙂"}
    ids = {rid: tok.encode(t, add_special_tokens=False) for rid, t in texts.items()}
    msgs: list[DetokMessage] = [register("c"), register("a", stop=["thing"]), register("b")]
    for i in range(max(len(v) for v in ids.values())):
        deltas = []
        for rid in ("a", "b", "c"):
            if i < len(ids[rid]):
                last = rid == "b" and i == len(ids[rid]) - 1
                fin = "length" if last else None
                deltas.append(TokenDelta(rid=rid, token_ids=[ids[rid][i]], finish=fin))
        msgs.append(StepOutput(executor="e", step=i, deltas=deltas))
    return msgs


async def entries(r: aioredis.Redis, after: str) -> list[Entry[DetokMessage]]:
    raw = await r.xread({STREAM: after}, count=10_000)
    return [Entry(i, DECODE.decode(f[FIELD])) for i, f in raw[0][1]] if raw else []


async def replies(r: aioredis.Redis, rid: str) -> list[ReplyMessage]:
    return [REPLY.decode(f[FIELD]) for _, f in await r.xrange(f"rs:reply:{rid}")]


async def take_over(r: aioredis.Redis, tok: Any) -> tuple[Partition, str]:
    saved = await r.get(recovery.checkpoint_key(STREAM))
    rec = recovery.decode(await r.get(recovery.recovery_key(STREAM)))
    resume = resume_point(saved, rec)
    return Partition(tok, constants.SCHEDULE_STREAM, resume, rec), resume.read_after


async def run(
    r: aioredis.Redis, leases: Leases, part: Partition, after: str, batch: int
) -> tuple[str, bool]:
    """Feed what the stream holds after `after` in batches, committing each and trimming the
    stream to each committed low-water mark; (last id, all commits accepted)."""
    items = await entries(r, after)
    for i in range(0, len(items), batch):
        c = part.feed(items[i : i + batch], now=time.monotonic() + i)
        if (c.checkpoint or c.out) and not await leases.commit(0, c.out, c.checkpoint, c.recovery):
            return after, False
        if c.low_water:  # as the service does, exactly rather than approximately
            await r.xtrim(STREAM, minid=c.low_water, approximate=False)
        after = recovery.id_str(items[i + batch - 1 if i + batch <= len(items) else -1].id)
    return after, True


async def uninterrupted(tok: Any, msgs: list[DetokMessage]) -> dict[str, list[Delta]]:
    part = Partition(tok, "sched", resume_point(None, None))
    out: dict[str, list[Delta]] = {}
    for n, m in enumerate(msgs):
        for stream, reply in part.feed([Entry(f"1-{n}".encode(), m)]).out:
            if isinstance(reply, Delta):
                out.setdefault(stream.rsplit(":", 1)[1], []).append(reply)
    return out


@pytest.mark.parametrize("cut", [4, 7, 11])
async def test_takeover_mid_stream_answers_each_delta_exactly_once(
    aredis: aioredis.Redis, tok: Any, cut: int
) -> None:
    msgs = script(tok)
    first = Leases(aredis, "first", partitions=1)
    assert await first.take_any() == 0
    for m in msgs[:cut]:
        await publish(aredis, STREAM, m)
    part, after = await take_over(aredis, tok)
    _, ok = await run(aredis, first, part, after, batch=2)
    assert ok
    # The first owner dies (SIGKILL: no release); the rest arrives meanwhile.
    for m in msgs[cut:]:
        await publish(aredis, STREAM, m)
    await aredis.delete(lease_key(0))  # its lease runs out
    second = Leases(aredis, "second", partitions=1)
    assert await second.take_any() == 0
    part2, after2 = await take_over(aredis, tok)
    assert part2.replaying  # request c (and maybe a) were open: they are rebuilt
    _, ok = await run(aredis, second, part2, after2, batch=3)
    assert ok
    expected = await uninterrupted(tok, msgs)
    for rid in ("a", "b", "c"):
        got = [m for m in await replies(aredis, rid) if isinstance(m, Delta)]
        assert len(got) == len(await replies(aredis, rid))  # deltas only
        assert [m.text for m in got] == [m.text for m in expected[rid]]  # (no duplicates)
        assert [m.token_ids for m in got] == [m.token_ids for m in expected[rid]]
    assert "".join(m.text for m in expected["a"]) == "the thin "
    assert part2.detok.unknown == 0
    # c is still open: the recovery record names it and keeps its registration as the mark.
    rec = recovery.decode(await aredis.get(recovery.recovery_key(STREAM)))
    assert rec is not None and list(rec.open) == ["c"]
    first_entry = (await aredis.xrange(STREAM, count=1))[0][0]
    assert rec.low_water == first_entry.decode()


async def test_an_owner_that_lost_its_lease_publishes_nothing(
    aredis: aioredis.Redis, tok: Any
) -> None:
    old, new = Leases(aredis, "old", 1), Leases(aredis, "new", 1)
    assert await old.take_any() == 0
    assert await new.take_any() is None  # owned: a standby waits
    await aredis.delete(lease_key(0))
    assert await new.take_any() == 0
    assert not await old.extend(0)
    usage = Usage(prompt_tokens=1, completion_tokens=1)
    delta = Delta(rid="x", text="late", token_ids=[1], usage=usage)
    assert not await old.commit(0, [("rs:reply:x", delta)], "5-0")
    assert await aredis.xlen("rs:reply:x") == 0
    assert await aredis.get(recovery.checkpoint_key(STREAM)) is None
    await old.release(0)  # not its lease any more: left alone
    assert await new.holder_of(0) == "new"
    assert await new.commit(0, [("rs:reply:x", delta)], "5-0")
    assert await aredis.xlen("rs:reply:x") == 1
    await new.release(0)
    assert await new.holder_of(0) is None


async def test_unpinned_instances_spread_over_free_partitions(aredis: aioredis.Redis) -> None:
    a, b, c = (Leases(aredis, n, partitions=2) for n in "abc")
    assert await a.take_any() == 0
    assert await b.take_any() == 1
    assert await c.take_any() is None
    assert await c.take_any(pinned=1) is None
    ttl = await aredis.pttl(lease_key(1))
    assert 0 < ttl <= 3000  # expires when its holder stops refreshing it
    assert await b.extend(1)


async def test_open_request_whose_registration_was_trimmed_fails_with_retryable_503(
    aredis: aioredis.Redis, tok: Any
) -> None:
    first = Leases(aredis, "first", 1)
    assert await first.take_any() == 0
    await publish(aredis, STREAM, register("lost"))
    part, after = await take_over(aredis, tok)
    assert (await run(aredis, first, part, after, batch=1))[1]
    # The stream is trimmed past its registration while it is open; then its owner dies.
    step = StepOutput(executor="e", step=0, deltas=[TokenDelta(rid="lost", token_ids=[104])])
    last = await publish(aredis, STREAM, step)
    await aredis.xtrim(STREAM, minid=last.decode(), approximate=False)
    await aredis.delete(lease_key(0))
    second = Leases(aredis, "second", 1)
    assert await second.take_any() == 0
    part2, after2 = await take_over(aredis, tok)
    assert (await run(aredis, second, part2, after2, batch=1))[1]
    got = await replies(aredis, "lost")
    assert len(got) == 1 and isinstance(got[-1], Failure)  # not its later tokens either
    assert got[-1].error.status == 503 and got[-1].error.retry_after == 1


async def test_tokens_of_a_request_never_registered_are_counted_not_silent(tok: Any) -> None:
    part = Partition(tok, "sched", resume_point(None, None))
    step = StepOutput(executor="e", step=0, deltas=[TokenDelta(rid="ghost", token_ids=[104])])
    assert part.feed([Entry(b"1-0", step)]).out == []
    assert part.feed([Entry(b"1-1", step)]).out == []
    assert part.detok.unknown == 1  # logged once per request


async def test_the_stream_is_trimmed_to_the_low_water_mark_and_a_successor_still_replays(
    aredis: aioredis.Redis, tok: Any
) -> None:
    first = Leases(aredis, "first", 1)
    assert await first.take_any() == 0
    done = [
        register("done"),
        StepOutput(
            executor="e", step=0, deltas=[TokenDelta(rid="done", token_ids=[104], finish="length")]
        ),
    ]
    ids_open = tok.encode("still going", add_special_tokens=False)
    opened = [register("open")] + [
        StepOutput(executor="e", step=1 + i, deltas=[TokenDelta(rid="open", token_ids=[t])])
        for i, t in enumerate(ids_open[:1])
    ]
    for m in done + opened:
        await publish(aredis, STREAM, m)
    part, after = await take_over(aredis, tok)
    after, ok = await run(aredis, first, part, after, batch=len(done) + len(opened))
    assert ok
    # Only the open request's registration and what follows it are left.
    left = [DECODE.decode(f[FIELD]) for _, f in await aredis.xrange(STREAM)]
    assert left == opened
    # Its owner dies; the successor replays from the mark and finishes the open request.
    tail = StepOutput(
        executor="e",
        step=9,
        deltas=[TokenDelta(rid="open", token_ids=ids_open[1:], finish="length")],
    )
    await publish(aredis, STREAM, tail)
    await aredis.delete(lease_key(0))
    second = Leases(aredis, "second", 1)
    assert await second.take_any() == 0
    part2, after2 = await take_over(aredis, tok)
    assert (await run(aredis, second, part2, after2, batch=1))[1]
    got = [m for m in await replies(aredis, "open") if isinstance(m, Delta)]
    assert "".join(m.text for m in got) == "still going"
    assert got[-1].finish_reason == "length"
    assert part2.detok.unknown == 0
