"""The one listener of this gateway's reply stream, routing each message to its request.

Handlers `register` a queue before publishing their request and `unregister` it when they are
done; the listener puts every `Delta` / `Failure` into the queue of its rid. Messages for rids
no longer registered (finished, aborted, timed out) are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from shared.bus import StreamReader
from shared.messages.common import ErrorInfo
from shared.messages.reply import Delta, Failure, ReplyMessage

log = logging.getLogger(__name__)


class ReplyRouter:
    def __init__(self, r: aioredis.Redis, stream: str) -> None:
        self.stream = stream
        self.reader: StreamReader[ReplyMessage] = StreamReader(
            r, stream, ReplyMessage, trim_consumed=True
        )
        self.queues: dict[str, asyncio.Queue[ReplyMessage]] = {}  # rid -> its replies, in order
        self.dropped = 0  # messages whose rid was not registered
        # rid -> when its first delta (the one carrying HopTimes) was read; the handler pops it
        self.replied_at: dict[str, float] = {}
        self.failed: BaseException | None = None
        self.reader.on_restart.append(self.bus_restarted)

    async def start(self) -> None:
        """Pin the read position before any request is published, so no reply is missed."""
        await self.reader.start_from_now()

    def register(self, rid: str) -> asyncio.Queue[ReplyMessage]:
        assert rid not in self.queues, f"rid {rid} registered twice"
        queue: asyncio.Queue[ReplyMessage] = asyncio.Queue()
        self.queues[rid] = queue
        return queue

    def unregister(self, rid: str) -> None:
        self.queues.pop(rid, None)
        self.replied_at.pop(rid, None)

    def route(self, message: ReplyMessage) -> None:
        queue = self.queues.get(message.rid)
        if queue is None:
            self.dropped += 1
            log.debug("dropping reply for unknown rid %s", message.rid)
            return
        if isinstance(message, Delta) and message.hops is not None:
            self.replied_at[message.rid] = time.time()
        queue.put_nowait(message)

    def bus_restarted(self) -> None:
        """Redis restarted empty: the requests in flight were lost with its streams, so each
        waiting call fails now with a retryable 503 instead of hanging until its deadline."""
        error = ErrorInfo(
            status=503,
            message="the request bus (Redis) restarted and lost this request; please retry",
            type="server_error",
            retry_after=1,
        )
        if self.queues:
            log.warning("redis restarted: failing %d request(s) in flight", len(self.queues))
        for rid, queue in self.queues.items():
            queue.put_nowait(Failure(rid=rid, error=error))

    async def run(self) -> None:
        """Read and route until cancelled. If reading fails for good, every waiting request
        gets a 503 Failure (rather than hanging until its deadline) and the error propagates."""
        try:
            while True:
                for entry in await self.reader.read(count=512, block_ms=1000):
                    self.route(entry.message)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.failed = e
            log.error("reply listener on %s failed: %r", self.stream, e)
            message = "gateway lost its reply stream"
            error = ErrorInfo(status=503, message=message, type="server_error")
            for rid, queue in self.queues.items():
                queue.put_nowait(Failure(rid=rid, error=error))
            raise
