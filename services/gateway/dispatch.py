"""Publishing requests, waiting for their replies under a deadline, and aborting them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from services.gateway.admission import Admission
from services.gateway.background import Background
from services.gateway.batcher import Batcher
from services.gateway.errors import ApiError, invalid
from services.gateway.hop_stats import FirstToken, HopStats, stage_ms
from services.gateway.inflight import Call, Inflight
from services.gateway.metrics import GatewayMetrics, RequestClock
from services.gateway.replies import ReplyRouter
from services.gateway.tracing import RequestSpan
from services.gateway.validation import Job
from shared import constants
from shared.bus import TRANSIENT
from shared.messages.common import AbortRequest, ErrorInfo, HopTimes, Trace
from shared.messages.reply import Delta, Failure, GenerationReply, ReplyMessage
from shared.messages.tokenize import ChatPrompt, GenerateRequest
from shared.request_ids import request_ids
from shared.tracing import Tracing, fresh_traceparent

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
        admission: Admission,
        metrics: GatewayMetrics,
        tracing: Tracing,
        think_end: str = "",
    ) -> None:
        self.r, self.router, self.reply_to = r, router, reply_to
        self.request_timeout_s, self.admission = request_timeout_s, admission
        self.batcher = Batcher(r)  # every publication of this gateway, coalesced
        self.background = Background()  # abort publications, registry clean-up
        self.inflight = Inflight(r, self.background)
        self.hop_stats = HopStats()  # per-stage latency of recent requests' first tokens
        self.metrics, self.tracing = metrics, tracing
        # --reasoning-parser's end tag ("": none): sent with constrained chat requests, whose
        # grammar then starts after the thinking part (the tokenizer decides, see
        # GenerateRequest.think_end)
        self.think_end = think_end

    async def submit(
        self, jobs: list[Job], traceparent: str, timeout_s: float | None = None, owner: str = ""
    ) -> list[Pending]:
        """Register a reply queue for each job, then publish them all to the tokenizer (and
        record them in the in-flight registry, under `owner`) in one round trip. The jobs are
        one HTTP call: an abort of any of them aborts them all. `traceparent`: the client's
        ("" when it sent none)."""
        if self.router.failed is not None:
            raise ApiError(503, "the gateway lost its reply stream", type="server_error")
        await self._confirm_bus()
        refused = self.admission.check(len(self.router.queues), len(jobs))
        if refused is not None:
            raise refused
        # the ids they travel under (shared/request_ids.py): a client's rid gets its own each time
        ids = [request_ids(job.rid) for job in jobs]
        rids, keys = [rid for rid, _ in ids], [key for _, key in ids]
        for rid in rids:
            if rid in self.inflight.calls:
                raise invalid(f"rid {rid!r} is already in flight", "rid")
        if len(set(rids)) != len(rids):  # a client's rid "a-1" beside the samples of "a"
            raise invalid(
                "the request's rids (with their samples' rid-1, rid-2, ...) repeat", "rid"
            )
        call = Call(tuple(rids), owner, tuple(keys))
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.time() + timeout_s
        received = time.time()
        trace = Trace(
            rid="",
            reply_to=self.reply_to,
            deadline=deadline,
            traceparent=traceparent or ("" if self.tracing.on else fresh_traceparent()),
            hops=HopTimes(gateway_received=received),
        )
        spans = [
            RequestSpan(self.tracing, traceparent, received, {"rid": rid, "api": job.api})
            if self.tracing.on
            else None
            for rid, job in zip(rids, jobs, strict=True)
        ]
        requests = [
            GenerateRequest(
                trace=msgspec.structs.replace(
                    trace, rid=key, traceparent=span.traceparent if span else trace.traceparent
                ),
                prompt=job.prompt,
                sampling=job.sampling,
                stream=job.stream,
                constraint=job.constraint,
                think_end=self.think_end
                if job.constraint is not None and isinstance(job.prompt, ChatPrompt)
                else "",
                echo=job.echo,
                api=job.api,
                embed=job.embed,
                dimensions=job.dimensions,
            )
            for key, job, span in zip(keys, jobs, spans, strict=True)
        ]
        queues = [self.router.register(key) for key in keys]
        self.inflight.add(call)
        try:
            await self.batcher.publish(
                [(constants.TOKENIZE_STREAM, req) for req in requests],
                maxlen=constants.WORK_STREAM_MAXLEN,
                expiring=self.inflight.registry_keys(call, timeout_s),
            )
        except BaseException as e:
            for span in spans:
                if span is not None:
                    span.end("not published")
            for rid, key in zip(rids, keys, strict=True):
                self.router.unregister(key)
                self.inflight.release(rid)
                if isinstance(e, asyncio.CancelledError):  # it may have gone out: take it back
                    self.abort(key, "client disconnected")
            if isinstance(e, TRANSIENT):
                raise unreachable(e) from e
            raise
        return [
            Pending(self, rid, key, q, timeout_s, RequestClock(self.metrics, received), span)
            for rid, key, q, span in zip(rids, keys, queues, spans, strict=True)
        ]

    async def _confirm_bus(self) -> None:
        """Before registering a call: if the reply reader's last read failed, whether Redis
        restarted. A restart the reader has not noticed yet would otherwise fail the calls
        registered after it (published to the new server, and answerable) along with those
        it really lost: after a restart /health says 200 once the services beat again, while
        the reader may still be backing off."""
        try:
            await self.router.reader.confirm_server()
        except TRANSIENT as e:
            raise unreachable(e) from e

    async def call(
        self, build: Callable[[Trace], msgspec.Struct], timeout_s: float
    ) -> ReplyMessage:
        """One request the tokenizer answers with one message (tokenize, detokenize): publish
        `build(trace)`, wait for its reply. A Failure raises its ApiError; no answer within
        `timeout_s` is a 504."""
        if self.router.failed is not None:
            raise ApiError(503, "the gateway lost its reply stream", type="server_error")
        await self._confirm_bus()
        rid = f"call-{uuid.uuid4().hex}"
        trace = Trace(rid=rid, reply_to=self.reply_to, deadline=time.time() + timeout_s)
        queue = self.router.register(rid)
        try:
            try:
                await self.batcher.publish(
                    [(constants.TOKENIZE_STREAM, build(trace))], constants.WORK_STREAM_MAXLEN
                )
            except TRANSIENT as e:
                raise unreachable(e) from e
            try:
                async with asyncio.timeout(timeout_s):  # keeps a cancel, unlike 3.11's wait_for
                    reply = await queue.get()
            except TimeoutError:
                raise ApiError(504, f"no tokenizer answered within {timeout_s:g}s") from None
        finally:
            self.router.unregister(rid)
        if isinstance(reply, Failure):
            raise ApiError.from_info(reply.error)
        return reply

    def abort(self, rid: str, reason: str) -> None:
        """Publish an AbortRequest in the background (safe to call from a cancelled handler)."""
        self.background.spawn(self.publish_aborts([rid], reason), name=f"abort-{rid}")

    async def publish_aborts(self, rids: Sequence[str], reason: str) -> None:
        """Abort requests wherever they are: the scheduler forwards each to its executor, or
        ends it when it arrives if it has not yet (see services/scheduler/router.py)."""
        log.info("aborting %s: %s", ", ".join(rids), reason)
        aborts = [(constants.SCHEDULE_STREAM, AbortRequest(rid=rid, reason=reason)) for rid in rids]
        await self.batcher.publish(aborts, maxlen=constants.WORK_STREAM_MAXLEN)

    async def close(self) -> None:
        """Let the aborts and clean-ups already started reach Redis."""
        await self.background.wait(5.0)


class Pending:
    """One request in flight: its reply queue, its deadline, and whether it has ended. `rid`
    is the client's name for it, `key` the id it travels under.

    `close()` must be called when the handler is done (in a `finally`): it drops the queue and,
    unless the request ended (a final Delta or a Failure arrived), aborts it downstream.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        rid: str,
        key: str,
        queue: asyncio.Queue[ReplyMessage],
        timeout_s: float,
        clock: RequestClock,
        span: RequestSpan | None,
    ) -> None:
        self.dispatcher, self.rid, self.key = dispatcher, rid, key
        self.clock = clock
        self.span = span  # with tracing on
        self.queue, self.timeout_s = queue, timeout_s
        self.until = asyncio.get_running_loop().time() + timeout_s  # monotonic deadline
        self.finished = False
        self.abort_reason = "gateway dropped the request"

    async def next(self, request: web.BaseRequest | None = None) -> GenerationReply:
        """The next reply. Raises ApiError(504) past the deadline, ClientGone if `request`'s
        connection is closed."""
        loop = asyncio.get_running_loop()
        while self.queue.empty():
            left = self.until - loop.time()
            if left <= 0:
                self.abort_reason = "deadline"
                raise ApiError(504, f"request timed out after {self.timeout_s:g}s")
            try:
                # asyncio.timeout, not wait_for: no task created per token of a stream
                async with asyncio.timeout(min(left, DISCONNECT_POLL_S)):
                    message = await self.queue.get()
                return self._seen(message)
            except TimeoutError:
                if request is not None and client_gone(request):
                    self.abort_reason = "client disconnected"
                    raise ClientGone() from None
        return self._seen(self.queue.get_nowait())

    def ready(self) -> list[GenerationReply]:
        """The replies already queued, up to and including the last one (none once it has
        been taken): what a stream can send in one write when it has fallen behind."""
        out: list[GenerationReply] = []
        while not self.finished and not self.queue.empty():
            out.append(self._seen(self.queue.get_nowait()))
        return out

    def first_token(self, hops: HopTimes) -> dict[str, float]:
        """Called by the handler as it takes the request's first delta (the one that carries
        `hops`): its per-stage latencies, also recorded in this gateway's medians."""
        replied = self.dispatcher.router.replied_at.pop(self.key, 0.0)
        stages = stage_ms(FirstToken(hops, replied, time.time()))
        self.dispatcher.hop_stats.add(stages)
        self.dispatcher.metrics.first_token_stages(stages)
        log.debug("first token of %s: %s", self.rid, stages)
        return stages

    def _seen(self, message: ReplyMessage) -> GenerationReply:
        if not isinstance(message, Delta | Failure):  # only a bug could route one here
            info = ErrorInfo(status=500, message="unexpected reply", type="server_error")
            message = Failure(rid=self.rid, error=info)
        if isinstance(message, Failure) or message.finish_reason is not None:
            self.finished = True
        self.clock.seen(message)
        if self.span is not None:
            self.span.seen(message)
        return message

    def close(self) -> None:
        self.clock.end()  # (nothing when its final reply was seen)
        if self.span is not None:
            self.span.end("" if self.finished else self.abort_reason)
        self.dispatcher.router.unregister(self.key)
        self.dispatcher.inflight.release(self.rid)
        if not self.finished:
            self.dispatcher.abort(self.key, self.abort_reason)


def unreachable(e: BaseException) -> ApiError:
    return ApiError(503, f"cannot reach the request bus: {e}", retry_after=1.0)


def client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
