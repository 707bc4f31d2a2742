"""Exclusive ownership of detokenizer partitions through leases in Redis.

A partition's lease is a key `{stream}:lease` holding its owner's id with a short TTL: taken
with SET NX PX, extended by its holder with a compare-and-extend script. When a holder dies its
lease expires within LEASE_TTL_S and another instance (or the restarted one) takes it over.

Ownership is also checked where it matters: `commit` publishes the replies and moves the
checkpoint in one script that first checks the lease, so an owner that lost its lease (paused
past the TTL while another took over) cannot publish anything, and no reply is sent twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import redis.asyncio as aioredis

from services.detokenizer.recovery import checkpoint_key, recovery_key
from shared import constants
from shared.bus import FIELD

LEASE_TTL_S = 3.0
# The holder extends its lease this often: two refreshes may fail before it expires.
REFRESH_EVERY_S = 1.0

_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: lease, checkpoint, recovery, then one stream per message.
# ARGV: holder, checkpoint id, recovery record ("" = unchanged), maxlen, lease ms, payloads.
_COMMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
for i = 4, #KEYS do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[4], '*', 'm', ARGV[i + 2])
end
redis.call('SET', KEYS[2], ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[3], ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

assert FIELD == b"m"  # the field _COMMIT writes


def lease_key(partition: int) -> str:
    return constants.detok_lease_key(partition)


class Leases:
    """The leases one detokenizer instance (`holder`) takes, keeps and gives back."""

    def __init__(self, r: aioredis.Redis, holder: str, partitions: int) -> None:
        self.r, self.holder, self.partitions = r, holder, partitions
        self.ttl_ms = int(LEASE_TTL_S * 1000)
        self._extend = r.register_script(_EXTEND)
        self._release = r.register_script(_RELEASE)
        self._commit = r.register_script(_COMMIT)
        self._encoder = msgspec.msgpack.Encoder()

    async def try_take(self, partition: int) -> bool:
        return bool(await self.r.set(lease_key(partition), self.holder, nx=True, px=self.ttl_ms))

    async def take_any(self, pinned: int | None = None) -> int | None:
        """The partition now held: `pinned` if given and free, else the first free one."""
        candidates = [pinned] if pinned is not None else range(self.partitions)
        for p in candidates:
            if await self.try_take(p):
                return p
        return None

    async def extend(self, partition: int) -> bool:
        """Whether this holder still owns `partition` (its lease is extended if so)."""
        args = [self.holder, self.ttl_ms]
        return bool(await self._extend(keys=[lease_key(partition)], args=args))

    async def release(self, partition: int) -> None:
        await self._release(keys=[lease_key(partition)], args=[self.holder])

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
        keys = [lease_key(partition), checkpoint_key(stream), recovery_key(stream)]
        keys += [s for s, _ in items]
        args: list[bytes | str | int] = [self.holder, checkpoint, recovery, maxlen, self.ttl_ms]
        args += [self._encoder.encode(m) for _, m in items]
        return bool(await self._commit(keys=keys, args=args))
