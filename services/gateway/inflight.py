"""Which requests are in flight: this gateway's HTTP calls, and a registry in Redis that every
gateway reads, so POST /abort_request reaches a request whichever gateway dispatched it.

`constants.rid_key(rid)` holds the call's owner (its caller's key digest, "" when anonymous:
services/gateway/access_policy.py) and every rid dispatched by the same HTTP call (its `n`
samples, its batch's other prompts), with the id each travels under on the bus
(shared/request_ids.py): an abort of one rid aborts the whole call, which answers as one, and
only its owner or an admin may abort it. The keys are set in the round trip that publishes the
requests, with the requests' timeout as TTL, and deleted when the call ends (a crashed
gateway's keys expire).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import msgspec
import redis.asyncio as aioredis

from services.gateway.background import Background
from shared import constants
from shared.bus import TRANSIENT

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.encode


class Call(NamedTuple):
    rids: tuple[str, ...]  # every rid of one HTTP call, as its client knows them
    owner: str  # who dispatched it: a key digest, "" when anonymous
    keys: tuple[str, ...] = ()  # the ids they travel under on the bus (empty: the rids)

    def bus_ids(self) -> tuple[str, ...]:
        return self.keys or self.rids


_decode_call = msgspec.msgpack.Decoder(Call).decode
NO_CALL = Call((), "")


class Inflight:
    def __init__(self, r: aioredis.Redis, background: Background) -> None:
        self.r, self.background = r, background
        self.calls: dict[str, Call] = {}  # rid -> its HTTP call
        self._released: list[str] = []  # rids whose registry keys are not deleted yet
        self._deleting = False  # a delete task is running: it takes what is released meanwhile

    def registry_keys(self, call: Call, ttl_s: float) -> list[tuple[str, bytes, float]]:
        """The `(key, value, ttl_s)` entries to set with the requests' publication."""
        value = _encode(call)
        return [(constants.rid_key(rid), value, ttl_s) for rid in call.rids]

    def add(self, call: Call) -> None:
        for rid in call.rids:
            self.calls[rid] = call

    def owned_by(self, owner: str | None) -> Call:
        """This gateway's calls in flight for `owner` (every one's when None) as one, sorted
        by rid."""
        pairs = sorted(
            (rid, call.bus_ids()[call.rids.index(rid)])
            for rid, call in self.calls.items()
            if owner is None or call.owner == owner
        )
        return Call(tuple(r for r, _ in pairs), owner or "", tuple(k for _, k in pairs))

    def release(self, rid: str) -> None:
        """The request ended here: forget it, and delete its key soon, in batches."""
        if self.calls.pop(rid, None) is None:
            return
        self._released.append(rid)
        if not self._deleting:
            self._deleting = True
            self.background.spawn(self._delete(), name="release-rids")

    async def _delete(self) -> None:
        try:
            while self._released:
                keys = [constants.rid_key(rid) for rid in self._released]
                self._released.clear()
                try:
                    await self.r.delete(*keys)
                except TRANSIENT as e:  # they expire by their TTL anyway
                    log.warning("could not delete %d rid key(s): %s", len(keys), e)
        finally:
            self._deleting = False

    async def lookup(self, rid: str) -> Call:
        """The HTTP call that dispatched `rid` (every rid of it, and its owner), from this
        gateway or from the registry; no rids when no gateway has it in flight."""
        local = self.calls.get(rid)
        if local is not None:
            return local
        raw = await self.r.get(constants.rid_key(rid))
        return _decode_call(raw) if raw is not None else NO_CALL
