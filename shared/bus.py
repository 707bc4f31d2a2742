"""One typed layer over Redis streams.

Each entry holds one msgpack-encoded message in field `m`. Two readers:

- `GroupConsumer`: a work queue read through a consumer group. Entries are acked by the
  caller after its side effect; entries another consumer left pending longer than
  `claim_idle_ms` are taken over with XAUTOCLAIM, so a crashed replica loses nothing. Given
  the consumers' service, a consumer whose liveness key is gone (deleted by the supervisor
  when the process exits, or expired) is known dead: its entries are taken over within
  DEAD_CHECK_S, without waiting for `claim_idle_ms`.
- `StreamReader`: a per-instance stream with exactly one reader (XREAD from the last id seen).

Both survive a Redis restart or a dropped connection: reads retry with exponential backoff and
a lost consumer group is re-created. Blocking reads run on a connection of their own (see
`dedicated`), so they never hold one of the pool's, and surface its errors at once: after any
error a reader compares the server's `run_id` with the one it started on, and on a change (a
restarted, empty Redis) it starts over from the new streams' beginning and tells its owner
(`on_restart`), which drops the state of requests that can no longer be answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import constants

log = logging.getLogger(__name__)

T = TypeVar("T")
FIELD = b"m"
# How often a StreamReader with trim_consumed trims what it has read (one XTRIM per interval).
TRIM_INTERVAL_S = 0.5
# How often a GroupConsumer given its service looks for dead consumers' entries: one XPENDING
# summary (and an EXISTS per consumer holding entries) a second.
DEAD_CHECK_S = 1.0
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionResetError, OSError)


# Seconds a command waits for a free pooled connection before failing (as a transient error).
POOL_WAIT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 64


def connect(url: str, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> aioredis.Redis:
    """A client whose commands retry transient failures with backoff, over at most
    `max_connections` sockets: past that a command waits for a free one (a burst queues
    instead of failing with "Too many connections")."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=POOL_WAIT_S,
        # asyncio's Retry: the client awaits its command inside call_with_retry, and the sync
        # redis.retry.Retry returns the coroutine unawaited, so a failure escaped with no retry
        # at all (the first command on each pooled connection after a Redis restart failed).
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=15,
    )
    return aioredis.Redis.from_pool(pool)


def dedicated(r: aioredis.Redis) -> aioredis.Redis:
    """A one-connection client to `r`'s server for one reader's blocking reads. It does not
    retry: a dropped connection surfaces at once, so the reader checks for a restart before it
    reads again (a transparent retry could read a restarted server's entries from a stale id)."""
    source = r.connection_pool
    kwargs = dict(source.connection_kwargs)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    kwargs.pop("maint_notifications_pool_handler", None)  # each pool makes its own
    pool = aioredis.BlockingConnectionPool(
        connection_class=source.connection_class, max_connections=1, timeout=None, **kwargs
    )
    client = aioredis.Redis.from_pool(pool)
    _dedicated.setdefault(r, []).append(client)
    return client


# client -> the dedicated clients made from it, closed with it by `close`
_dedicated: weakref.WeakKeyDictionary[aioredis.Redis, list[aioredis.Redis]] = (
    weakref.WeakKeyDictionary()
)


async def close(r: aioredis.Redis) -> None:
    """Close `r` and the readers' connections made from it."""
    for client in _dedicated.pop(r, []):
        await client.aclose()
    await r.aclose()


async def server_run_id(r: aioredis.Redis) -> str:
    """The id Redis picks at each start: it changes exactly when the server restarted."""
    info = await r.info("server")
    return str(info["run_id"])


class Backoff:
    """Sleeps 50 ms, 100 ms, ... up to `cap` seconds between failed attempts; reset on success."""

    def __init__(self, base: float = 0.05, cap: float = 2.0) -> None:
        self.base, self.cap, self.attempt = base, cap, 0

    async def wait(self) -> None:
        await asyncio.sleep(min(self.cap, self.base * 2**self.attempt))
        self.attempt += 1

    def reset(self) -> None:
        self.attempt = 0


class Entry(NamedTuple, Generic[T]):
    id: bytes
    message: T


class Codec(Generic[T]):
    """msgpack encoding of one message type (usually a tagged union)."""

    def __init__(self, type_: Any) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)

    def encode(self, message: T) -> bytes:
        return self.encoder.encode(message)

    def decode(self, data: bytes) -> T:
        return self.decoder.decode(data)


_encoder = msgspec.msgpack.Encoder()


async def publish(
    r: aioredis.Redis, stream: str, message: msgspec.Struct, maxlen: int | None = None
) -> bytes:
    """XADD one message, trimming the stream approximately to `maxlen` entries."""
    limit = constants.INSTANCE_STREAM_MAXLEN if maxlen is None else maxlen
    return await r.xadd(stream, {FIELD: _encoder.encode(message)}, maxlen=limit, approximate=True)


async def publish_many(
    r: aioredis.Redis,
    items: Sequence[tuple[str, msgspec.Struct]],
    maxlen: int | None = None,
    checkpoint: tuple[str, bytes | str] | None = None,
    expiring: Sequence[tuple[str, bytes, float]] = (),
    ack: tuple[str, str, Sequence[bytes]] | None = None,
    extra: Callable[[Pipeline], None] | None = None,
) -> None:
    """XADD several messages in one round trip, in order. With `checkpoint=(key, entry_id)`
    the messages and SET key entry_id happen atomically (MULTI), so a reader that resumes
    from its checkpoint neither loses nor repeats what it published. `expiring` keys
    `(key, value, ttl_s)` are set in the same round trip, before the messages. With
    `ack=(stream, group, ids)` the consumed entries are acked atomically with the messages
    they led to (MULTI): still never acked without their side effect, and one round trip
    where publishing then acking took two before the next read. `extra` adds the caller's
    own commands to the same pipeline (and transaction), after the messages."""
    limit = constants.INSTANCE_STREAM_MAXLEN if maxlen is None else maxlen
    atomic = checkpoint is not None or bool(ack and ack[2]) or extra is not None
    pipe = r.pipeline(transaction=atomic)
    for key, value, ttl_s in expiring:
        pipe.set(key, value, px=max(1, int(ttl_s * 1000)))
    for stream, message in items:
        pipe.xadd(stream, {FIELD: _encoder.encode(message)}, maxlen=limit, approximate=True)
    if extra is not None:
        extra(pipe)
    if checkpoint is not None:
        pipe.set(checkpoint[0], checkpoint[1])
    if ack is not None and ack[2]:
        pipe.xack(ack[0], ack[1], *ack[2])
    if len(pipe):
        await pipe.execute()


def _raise_if_cancelling() -> None:
    """redis-py (8.1) can swallow a cancellation that lands while it (re)connects and return
    the command's result: a reader cancelled then would read on forever. Honour it here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class _Reader(Generic[T]):
    def __init__(self, r: aioredis.Redis, stream: str, type_: Any) -> None:
        self.r, self.stream, self.codec = r, stream, Codec[T](type_)
        self.rb = dedicated(r)  # blocking reads only
        self.backoff = Backoff()
        self.run_id: str | None = None  # the server's, as this reader last saw it
        self._suspect = True  # check the run_id before the next read (first read, errors)
        self.on_restart: list[Callable[[], None]] = []  # called when Redis restarted empty
        self.restarts = 0
        # Called with the ids of each batch of new entries read (metrics: how long they waited)
        self.on_entries: list[Callable[[Sequence[bytes]], None]] = []

    async def check_restart(self) -> bool:
        """Whether Redis restarted since this reader last looked (the first look records)."""
        current = await server_run_id(self.r)
        previous, self.run_id = self.run_id, current
        if previous is None or previous == current:
            return False
        self.restarts += 1
        log.warning(
            "redis restarted (run_id %s -> %s): %s starts over", previous, current, self.stream
        )
        self._restarted()
        for callback in self.on_restart:
            callback()
        return True

    @property
    def unconfirmed(self) -> bool:
        """Whether a read failed since this reader last made sure of the server: until it
        looks again, a Redis restart is not known here (it backs off up to 2 s first)."""
        return self._suspect

    async def confirm_server(self) -> None:
        """Look for a restart now, if a read failed since the last look: its `on_restart`
        callbacks run before this returns. For an owner about to add state that a restart
        would drop (a gateway registering a call), so that a restart it has not noticed yet
        drops only what came before it. No round trip while reads succeed. The reader's own
        loop still looks again before its next read (that look finds nothing new)."""
        if self._suspect:
            await self.check_restart()

    def _restarted(self) -> None:
        """What a reader resets when the server restarted empty."""

    async def _before_read(self) -> None:
        if self._suspect:
            await self.check_restart()
            self._suspect = False

    async def _failed(self, e: BaseException) -> None:
        _raise_if_cancelling()
        log.warning("redis unavailable reading %s (%s); retrying", self.stream, e)
        self._suspect = True
        await self.backoff.wait()

    def _seen(self, raw: list[Any]) -> None:
        for callback in self.on_entries:
            callback([entry_id for entry_id, _ in raw])

    async def close(self) -> None:
        """Close the reader's own connection (`close(r)` also does)."""
        await self.rb.aclose()

    def _decode_entries(self, raw: list[Any]) -> tuple[list[Entry[T]], list[bytes]]:
        """Decode entries; undecodable ones are logged and returned separately for acking."""
        good: list[Entry[T]] = []
        bad: list[bytes] = []
        for entry_id, fields in raw:
            if fields is None or FIELD not in fields:  # deleted by trimming while pending
                bad.append(entry_id)
                continue
            try:
                good.append(Entry(entry_id, self.codec.decode(fields[FIELD])))
            except msgspec.DecodeError as e:
                log.error("dropping undecodable entry %s on %s: %s", entry_id, self.stream, e)
                bad.append(entry_id)
        return good, bad


class GroupConsumer(_Reader[T]):
    """Reads a work queue as one member of a consumer group; the caller acks after its work."""

    def __init__(
        self,
        r: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        type_: Any,
        claim_idle_ms: int = constants.CLAIM_IDLE_MS,
        service: str | None = None,
    ) -> None:
        super().__init__(r, stream, type_)
        self.group, self.consumer, self.claim_idle_ms = group, consumer, claim_idle_ms
        self.service = service  # the consumers' liveness keys: rs:live:{service}:{consumer}
        self._last_claim = 0.0
        self._last_dead_check = 0.0

    async def ensure_group(self) -> None:
        try:
            await self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def claim_stale(self) -> list[Entry[T]]:
        """Take over entries other consumers left pending for longer than `claim_idle_ms`."""
        claimed: list[Entry[T]] = []
        start = "0-0"
        while True:
            res = await self.r.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, start, count=100
            )
            start, raw = res[0], res[1]
            good, bad = self._decode_entries(raw)
            claimed += good
            if bad:
                await self.ack([b for b in bad])
            if start in (b"0-0", "0-0"):
                return claimed

    async def claim_from_dead(self) -> list[Entry[T]]:
        """Take over, whatever their idle time, the entries of consumers whose liveness key
        is gone. A live consumer's entries are never taken here, however long they wait: a
        busy replica is not a dead one (claim_stale covers one that hangs)."""
        if self.service is None:
            return []
        summary = await self.r.xpending(self.stream, self.group)
        claimed: list[Entry[T]] = []
        for c in summary.get("consumers") or []:
            name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
            if name == self.consumer or await self.r.exists(constants.live_key(self.service, name)):
                continue
            pending = await self.r.xpending_range(
                self.stream, self.group, "-", "+", int(c["pending"]), consumername=name
            )
            ids = [p["message_id"] for p in pending]
            if not ids:
                continue
            raw = await self.r.xclaim(self.stream, self.group, self.consumer, 0, ids)
            good, bad = self._decode_entries([e for e in raw if e is not None])
            if bad:
                await self.ack(bad)
            if good:
                log.info("took over %d entries of %s, which is gone", len(good), name)
            claimed += good
        return claimed

    async def read(self, count: int = 64, block_ms: int = 1000) -> list[Entry[T]]:
        """New entries for this consumer (plus those claimed from dead consumers)."""
        while True:
            try:
                entries: list[Entry[T]] = []
                now = time.monotonic()
                if self.service is not None and now - self._last_dead_check > DEAD_CHECK_S:
                    self._last_dead_check = now
                    entries = await self.claim_from_dead()
                if not entries and now - self._last_claim > self.claim_idle_ms / 2000:
                    self._last_claim = now
                    entries = await self.claim_stale()
                if entries:
                    return entries
                await self._before_read()
                res = await self.rb.xreadgroup(
                    self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
                )
                _raise_if_cancelling()
                self.backoff.reset()
                if not res:
                    return []
                self._seen(res[0][1])
                good, bad = self._decode_entries(res[0][1])
                if bad:
                    await self.ack(bad)
                return good
            except ResponseError as e:
                # NOGROUP: the group is gone (Redis restarted empty); UNBLOCKED: the stream was
                # deleted while this read was blocked on it (Redis 7). Both: start over.
                if "NOGROUP" not in str(e) and "UNBLOCKED" not in str(e):
                    raise
                log.warning(
                    "consumer group %s on %s vanished; re-creating", self.group, self.stream
                )
                await self.ensure_group()
            except TRANSIENT as e:
                await self._failed(e)

    async def ack(self, ids: Sequence[bytes]) -> None:
        if ids:
            await self.r.xack(self.stream, self.group, *ids)

    async def commit(
        self,
        out: Sequence[tuple[str, msgspec.Struct]],
        ids: Sequence[bytes],
        maxlen: int,
        extra: Callable[[Pipeline], None] | None = None,
    ) -> None:
        """Publish what entries `ids` led to (and `extra`'s commands) and ack them,
        atomically, in one round trip."""
        ack = (self.stream, self.group, ids)
        await publish_many(self.r, out, maxlen=maxlen, ack=ack, extra=extra)


class StreamReader(_Reader[T]):
    """The single reader of a per-instance stream. Starts at `$` (only what arrives from now
    on) unless told to start at an earlier id."""

    def __init__(
        self,
        r: aioredis.Redis,
        stream: str,
        type_: Any,
        last_id: str = "$",
        trim_consumed: bool = False,
    ) -> None:
        super().__init__(r, stream, type_)
        self.last_id: str | bytes = last_id
        # With `trim_consumed`, what this reader has read is trimmed away behind it (XTRIM
        # MINID), so the stream holds only unread entries. The writers' MAXLEN is then only a
        # cap for a reader that died: a reader that merely lags (a gateway under a burst of
        # 2,000 streams) never loses an unread entry to it.
        self.trim_consumed = trim_consumed
        self._trimmed_at = 0.0

    async def trim_before(self, entry_id: str | bytes) -> None:
        """Drop the entries older than `entry_id` (approximately: whole radix-tree nodes, never
        an entry at or after it). Best effort: a failure only leaves them for the next call."""
        try:
            await self.r.xtrim(self.stream, minid=entry_id, approximate=True)
        except TRANSIENT as e:
            log.debug("could not trim %s: %s", self.stream, e)

    async def _maybe_trim(self) -> None:
        now = time.monotonic()
        if now - self._trimmed_at >= TRIM_INTERVAL_S:
            self._trimmed_at = now
            await self.trim_before(self.last_id)

    async def start_from_now(self) -> None:
        """Pin the position to the stream's current end so no entry is skipped by '$' races.
        Waits out a Redis outage (a service starting while Redis restarts), like `read`."""
        while True:
            try:
                await self.check_restart()
                self._suspect = False
                exists = await self.r.exists(self.stream)
                info = await self.r.xinfo_stream(self.stream) if exists else None
                self.last_id = info["last-generated-id"] if info else "0-0"
                self.backoff.reset()
                return
            except TRANSIENT as e:
                await self._failed(e)

    async def read(self, count: int = 256, block_ms: int = 1000) -> list[Entry[T]]:
        while True:
            try:
                await self._before_read()
                res = await self.rb.xread({self.stream: self.last_id}, count=count, block=block_ms)
                _raise_if_cancelling()
                self.backoff.reset()
                if not res:
                    return []
                raw = res[0][1]
                self.last_id = raw[-1][0]
                self._seen(raw)
                good, _ = self._decode_entries(raw)
                if self.trim_consumed:
                    await self._maybe_trim()
                return good
            except TRANSIENT as e:
                await self._failed(e)

    def _restarted(self) -> None:
        # The new server's stream began empty: its ids say nothing about the old position.
        self.last_id = "0-0"
