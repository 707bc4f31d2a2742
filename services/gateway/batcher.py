"""Coalesced publishing: what many handlers publish at about the same time goes to Redis in
one pipeline, so a burst of 2,000 requests costs a handful of round trips and connections,
not one connection each.

A handler's `publish` joins the next batch; one flusher at a time sends a batch and, while
that round trip is out, the next batch fills up (group commit). Each caller learns its own
outcome: a transient error of the round trip fails every caller of that batch (none of them
was acked as sent), a command's own error fails only the caller whose command it was.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

from shared.bus import FIELD

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode


@dataclass
class _Part:
    """One caller's commands: keys to set (before its messages), then its messages."""

    items: Sequence[tuple[str, msgspec.Struct]]
    maxlen: int
    expiring: Sequence[tuple[str, bytes, float]]
    done: asyncio.Future[None]


class Batcher:
    def __init__(self, r: aioredis.Redis, max_batch: int = 1024) -> None:
        self.r, self.max_batch = r, max_batch
        self._queue: list[_Part] = []
        self._flusher: asyncio.Task[None] | None = None
        self.round_trips = 0  # pipelines sent (for tests and stats)

    async def publish(
        self,
        items: Sequence[tuple[str, msgspec.Struct]],
        maxlen: int,
        expiring: Sequence[tuple[str, bytes, float]] = (),
    ) -> None:
        """XADD `items` in order (after setting the `(key, value, ttl_s)` keys), in a round
        trip shared with other callers. Returns once Redis has them; raises what failed them.
        A caller cancelled while waiting has its part sent anyway (it may already be out)."""
        part = _Part(items, maxlen, expiring, asyncio.get_running_loop().create_future())
        self._queue.append(part)
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_all(), name="publish-batcher")
        await asyncio.shield(part.done)

    async def _flush_all(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                await self._flush(batch)
        finally:
            self._flusher = None

    async def _flush(self, batch: list[_Part]) -> None:
        pipe = self.r.pipeline(transaction=False)
        sizes = []
        for part in batch:
            for key, value, ttl_s in part.expiring:
                pipe.set(key, value, px=max(1, int(ttl_s * 1000)))
            for stream, message in part.items:
                pipe.xadd(stream, {FIELD: _encode(message)}, maxlen=part.maxlen, approximate=True)
            sizes.append(len(part.expiring) + len(part.items))
        self.round_trips += 1
        try:
            results = await pipe.execute(raise_on_error=False)
        except BaseException as e:  # the round trip itself failed: nobody's part is known sent
            for part in batch:
                if not part.done.done():
                    part.done.set_exception(e)
                    part.done.exception()  # retrieved here: a cancelled caller must not warn
            if not isinstance(e, Exception):
                raise
            return
        at = 0
        for part, n in zip(batch, sizes, strict=True):
            error = next((x for x in results[at : at + n] if isinstance(x, Exception)), None)
            at += n
            if part.done.done():
                continue
            if error is None:
                part.done.set_result(None)
            else:
                part.done.set_exception(error)
                part.done.exception()
