"""Publishing requests, waiting for their replies under a deadline, and aborting them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis.asyncio as aioredis
from aiohttp import web

from services.gateway.errors import ApiError, invalid
from services.gateway.replies import ReplyRouter
from services.gateway.validation import Job
from shared import constants
from shared.bus import TRANSIENT, publish
from shared.messages.common import Trace
from shared.messages.reply import Failure, ReplyMessage
from shared.messages.tokenize import AbortRequest, GenerateRequest

log = logging.getLogger(__name__)

# How often a handler waiting for replies checks that its client is still connected (a
# fallback: with the runner's handler_cancellation the handler is cancelled at once).
DISCONNECT_POLL_S = 0.5


class ClientGone(Exception):
    """The HTTP client closed its connection."""


class Dispatcher:
    def __init__(
        self,
        r: aioredis.Redis,
        router: ReplyRouter,
        reply_to: str,
        request_timeout_s: float,
        max_inflight: int,
    ) -> None:
        self.r, self.router, self.reply_to = r, router, reply_to
        self.request_timeout_s, self.max_inflight = request_timeout_s, max_inflight
        self._aborts: set[asyncio.Task[None]] = set()  # abort publications still in flight

    async def submit(self, job: Job, traceparent: str) -> Pending:
        """Register a reply queue for the request, then publish it to the tokenizer."""
        if self.router.failed is not None:
            raise ApiError(503, "the gateway lost its reply stream", type="server_error")
        if len(self.router.queues) >= self.max_inflight:
            raise ApiError(503, f"too many requests in flight (limit {self.max_inflight})")
        rid = job.rid or uuid.uuid4().hex
        if rid in self.router.queues:
            raise invalid(f"rid {rid!r} is already in flight", "rid")
        queue = self.router.register(rid)
        deadline = time.time() + self.request_timeout_s
        trace = Trace(rid=rid, reply_to=self.reply_to, deadline=deadline, traceparent=traceparent)
        request = GenerateRequest(
            trace=trace,
            prompt=job.prompt,
            sampling=job.sampling,
            stream=job.stream,
            constraint=job.constraint,
            echo=job.echo,
        )
        try:
            await publish(self.r, constants.TOKENIZE_STREAM, request, constants.WORK_STREAM_MAXLEN)
        except asyncio.CancelledError:  # it may have gone out: take it back
            self.router.unregister(rid)
            self.abort(rid, "client disconnected")
            raise
        except TRANSIENT as e:
            self.router.unregister(rid)
            raise ApiError(503, f"cannot reach the request bus: {e}") from e
        except BaseException:
            self.router.unregister(rid)
            raise
        return Pending(self, rid, queue, self.request_timeout_s)

    def abort(self, rid: str, reason: str) -> None:
        """Publish an AbortRequest in the background (safe to call from a cancelled handler)."""
        task = asyncio.create_task(self._publish_abort(rid, reason), name=f"abort-{rid}")
        self._aborts.add(task)
        task.add_done_callback(self._abort_done)

    async def _publish_abort(self, rid: str, reason: str) -> None:
        log.info("aborting %s: %s", rid, reason)
        abort = AbortRequest(rid=rid, reason=reason)
        await publish(self.r, constants.SCHEDULE_STREAM, abort, constants.WORK_STREAM_MAXLEN)

    def _abort_done(self, task: asyncio.Task[None]) -> None:
        self._aborts.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("publishing %s failed: %r", task.get_name(), task.exception())

    async def close(self) -> None:
        """Let the aborts already started reach Redis."""
        if self._aborts:
            await asyncio.wait(self._aborts, timeout=5.0)


class Pending:
    """One request in flight: its reply queue, its deadline, and whether it has ended.

    `close()` must be called when the handler is done (in a `finally`): it drops the queue and,
    unless the request ended (a final Delta or a Failure arrived), aborts it downstream.
    """

    def __init__(
        self, dispatcher: Dispatcher, rid: str, queue: asyncio.Queue[ReplyMessage], timeout_s: float
    ) -> None:
        self.dispatcher, self.rid, self.queue, self.timeout_s = dispatcher, rid, queue, timeout_s
        self.until = asyncio.get_running_loop().time() + timeout_s  # monotonic deadline
        self.finished = False
        self.abort_reason = "gateway dropped the request"

    async def next(self, request: web.BaseRequest | None = None) -> ReplyMessage:
        """The next reply. Raises ApiError(504) past the deadline, ClientGone if `request`'s
        connection is closed."""
        loop = asyncio.get_running_loop()
        while self.queue.empty():
            left = self.until - loop.time()
            if left <= 0:
                self.abort_reason = "deadline"
                raise ApiError(504, f"request timed out after {self.timeout_s:g}s")
            try:
                message = await asyncio.wait_for(self.queue.get(), min(left, DISCONNECT_POLL_S))
                return self._seen(message)
            except asyncio.TimeoutError:
                if request is not None and client_gone(request):
                    self.abort_reason = "client disconnected"
                    raise ClientGone() from None
        return self._seen(self.queue.get_nowait())

    def _seen(self, message: ReplyMessage) -> ReplyMessage:
        if isinstance(message, Failure) or message.finish_reason is not None:
            self.finished = True
        return message

    def close(self) -> None:
        self.dispatcher.router.unregister(self.rid)
        if not self.finished:
            self.dispatcher.abort(self.rid, self.abort_reason)


def client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
