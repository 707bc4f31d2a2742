"""The scheduler's routing table, kept in Redis (one hash, `rs:routes`) beside its copy in
memory: which executor holds each request, and the request itself, until a detokenizer says
it is done. A scheduler that restarts (or a standby that takes over) rebuilds its table from
it, and a lost executor's requests are resumed from the stored requests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from shared import constants


class RouteRecord(msgspec.Struct, array_like=True, frozen=True):
    executor: str  # instance name
    detok_stream: str
    deadline: float  # unix seconds
    request: bytes  # the routed TokenizedRequest, msgpack
    reply_to: str = ""  # its gateway's reply stream


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RouteRecord)


def encode(record: RouteRecord) -> bytes:
    return _encoder.encode(record)


def decode(raw: bytes) -> RouteRecord | None:
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        return None  # written by another version: the request is failed, not resumed


def staged(saves: dict[str, bytes], deletes: Sequence[str]) -> Callable[[Pipeline], None]:
    """What adds the table's changes to a pipeline (the scheduler's commit: one round trip)."""

    def stage(pipe: Pipeline) -> None:
        if saves:
            pipe.hset(constants.ROUTES_KEY, mapping=saves)
        if deletes:
            pipe.hdel(constants.ROUTES_KEY, *deletes)

    return stage


async def load(r: aioredis.Redis, rids: Sequence[str]) -> dict[str, RouteRecord]:
    if not rids:
        return {}
    raw = await r.hmget(constants.ROUTES_KEY, list(rids))
    out = {}
    for rid, value in zip(rids, raw, strict=True):
        record = decode(value) if value is not None else None
        if record is not None:
            out[rid] = record
    return out


async def scan(r: aioredis.Redis) -> AsyncIterator[tuple[str, RouteRecord]]:
    """Every stored route (a new leader's table)."""
    async for rid, value in r.hscan_iter(constants.ROUTES_KEY, count=1000):
        record = decode(value)
        if record is not None:
            yield (rid.decode() if isinstance(rid, bytes) else rid), record
