"""Exclusive ownership of detokenizer partitions through leases in Redis.

A partition's lease is a key `{stream}:lease` holding its owner's id with a short TTL, and an
epoch `{stream}:lease:epoch`: a random token written by each take (SET NX PX), which its holder
remembers. Being random, it also changes across a Redis restart. When a holder dies its lease
expires within LEASE_TTL_S and another instance (or the restarted one) takes it over, with a new
epoch.

Ownership is checked where it matters: `commit` publishes the replies and moves the
checkpoint in one script that first checks the lease, so an owner that lost its lease (paused
past the TTL while another took over) cannot publish anything, and no reply is sent twice.

A holder whose lease merely expired (it was too busy, or Redis was away, to extend it in
time) while nobody else took it finds the epoch unchanged: the check takes the lease again
for it and it carries on, with no replay. Only a changed epoch (another owner existed, and
may have answered) means the lease is lost.

The lease is extended by a `LeaseKeeper` thread with a connection of its own, so a long batch
of work on the service's event loop (a replay of thousands of entries, a burst) never lets it
expire; the keeper stops extending only when the loop has made no progress for STALL_S.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence

import msgspec
import redis
import redis.asyncio as aioredis

from services.detokenizer.recovery import checkpoint_key, recovery_key
from shared import constants
from shared.bus import FIELD

log = logging.getLogger(__name__)

LEASE_TTL_S = 3.0
# The holder extends its lease this often: two refreshes may fail before it expires.
REFRESH_EVERY_S = 1.0
# An event loop that has not ticked for this long is stuck, not busy: its lease is let go.
STALL_S = 30.0

# Whether ARGV[1] (holder) with epoch ARGV[2] owns the lease KEYS[1] (epoch key KEYS[2]); a
# lease that expired with no other taker since (same epoch) is taken again, for ARGV[3] ms.
_OWNED = """
local function owned()
  if redis.call('GET', KEYS[2]) ~= ARGV[2] then
    return false
  end
  local h = redis.call('GET', KEYS[1])
  if h == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return true
  end
  if not h then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
    return true
  end
  return false
end
"""

_TAKE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[3])
  return 1
end
return 0
"""

_EXTEND = _OWNED + "\nif owned() then return 1 end\nreturn 0\n"

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: lease, epoch, checkpoint, recovery, then one stream per message.
# ARGV: holder, epoch, lease ms, checkpoint id, recovery record ("" = unchanged), maxlen,
# then the payloads.
_COMMIT = (
    _OWNED
    + """
if not owned() then
  return 0
end
for i = 5, #KEYS do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[6], '*', 'm', ARGV[i + 2])
end
redis.call('SET', KEYS[3], ARGV[4])
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[4], ARGV[5])
end
return 1
"""
)

assert FIELD == b"m"  # the field _COMMIT writes


def lease_key(partition: int) -> str:
    return constants.detok_lease_key(partition)


def epoch_key(partition: int) -> str:
    return f"{lease_key(partition)}:epoch"


class Leases:
    """The leases one detokenizer instance (`holder`) takes, keeps and gives back."""

    def __init__(
        self, r: aioredis.Redis, holder: str, partitions: int, ttl_s: float = LEASE_TTL_S
    ) -> None:
        self.r, self.holder, self.partitions = r, holder, partitions
        self.ttl_ms = int(ttl_s * 1000)
        self.epochs: dict[int, str] = {}  # partition -> the epoch this holder took it at
        self._take = r.register_script(_TAKE)
        self._extend = r.register_script(_EXTEND)
        self._release = r.register_script(_RELEASE)
        self._commit = r.register_script(_COMMIT)
        self._encoder = msgspec.msgpack.Encoder()

    async def try_take(self, partition: int) -> bool:
        keys = [lease_key(partition), epoch_key(partition)]
        epoch = uuid.uuid4().hex
        if not await self._take(keys=keys, args=[self.holder, self.ttl_ms, epoch]):
            return False
        self.epochs[partition] = epoch
        return True

    async def take_any(self, pinned: int | None = None) -> int | None:
        """The partition now held: `pinned` if given and free, else the first free one."""
        candidates = [pinned] if pinned is not None else range(self.partitions)
        for p in candidates:
            if await self.try_take(p):
                return p
        return None

    def _owned_args(self, partition: int) -> tuple[list[str], list[bytes | str | int]]:
        keys = [lease_key(partition), epoch_key(partition)]
        return keys, [self.holder, self.epochs.get(partition, ""), self.ttl_ms]

    async def extend(self, partition: int) -> bool:
        """Whether this holder still owns `partition` (its lease is extended, or taken again
        if it expired with no other taker, if so)."""
        keys, args = self._owned_args(partition)
        return bool(await self._extend(keys=keys, args=args))

    async def release(self, partition: int) -> None:
        await self._release(keys=[lease_key(partition)], args=[self.holder])
        self.epochs.pop(partition, None)

    async def holder_of(self, partition: int) -> str | None:
        v = await self.r.get(lease_key(partition))
        return v.decode() if v is not None else None

    async def commit(
        self,
        partition: int,
        items: Sequence[tuple[str, msgspec.Struct]],
        checkpoint: bytes | str,
        recovery: bytes = b"",
        maxlen: int = constants.INSTANCE_STREAM_MAXLEN,
    ) -> bool:
        """Publish `items` in order, move the checkpoint (and the recovery record, if given)
        and extend the lease, atomically, only while this holder owns `partition`. False:
        the lease is lost and nothing happened."""
        stream = constants.detok_stream(partition)
        keys, args = self._owned_args(partition)
        keys += [checkpoint_key(stream), recovery_key(stream)]
        keys += [s for s, _ in items]
        args += [checkpoint, recovery, maxlen]
        args += [self._encoder.encode(m) for _, m in items]
        return bool(await self._commit(keys=keys, args=args))


class LeaseKeeper:
    """Extends one held lease every `refresh_s` from a thread with its own connection, so
    that work on the event loop, however long, never lets it expire. `tick()` is called by
    the loop on every iteration: a loop silent for `stall_s` is taken as stuck and the lease is
    left to expire (a standby takes the partition over). `lost` is set once another holder
    has taken the partition."""

    def __init__(
        self,
        redis_url: str,
        leases: Leases,
        partition: int,
        refresh_s: float = REFRESH_EVERY_S,
        stall_s: float = STALL_S,
    ) -> None:
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._refresh_s, self._stall_s = refresh_s, stall_s
        self._client = redis.Redis.from_url(
            redis_url, socket_timeout=refresh_s, socket_connect_timeout=refresh_s
        )
        self._extend = self._client.register_script(_EXTEND)
        self._keys, self._args = leases._owned_args(partition)
        self._partition = partition
        self._ticked = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"lease-{partition}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def tick(self) -> None:
        self._ticked = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._refresh_s)
        self._client.close()

    def _run(self) -> None:
        stalled = False
        while not self._stop.wait(self._refresh_s):
            if time.monotonic() - self._ticked > self._stall_s:
                if not stalled:
                    log.error(
                        "partition %d: the event loop is stuck (%.0fs); letting the lease go",
                        self._partition,
                        time.monotonic() - self._ticked,
                    )
                stalled = True
                continue
            stalled = False
            try:
                owned = self._extend(keys=self._keys, args=self._args)
            except redis.RedisError as e:  # Redis away: the commit's check decides later
                log.debug("partition %d: lease refresh failed: %s", self._partition, e)
                continue
            if not owned:
                self.lost.set()
                return
