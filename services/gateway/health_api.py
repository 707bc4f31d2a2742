"""GET /health (every stage can serve right now) and GET or POST /health_generate (a real
one-token generation through all of them)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from services.gateway.dispatch import ClientGone
from services.gateway.errors import ApiError, error_body
from services.gateway.readiness import Readiness
from services.gateway.ready_gate import read_readiness
from services.gateway.responses import json_response, traceparent
from services.gateway.state import STATE, GatewayState
from services.gateway.validation import Job
from shared.bus import TRANSIENT
from shared.messages.common import SamplingParams
from shared.messages.reply import Failure
from shared.messages.tokenize import TextPrompt

# The probe of /health_generate: a tiny prompt, one greedy token. Its timeout leaves room for
# the probe to wait behind a long prefill on a busy CPU, and is short enough for a load
# balancer's check.
PROBE_PROMPT = "Hello"
PROBE_TIMEOUT_S = 10.0
# /health answers 503 rather than wait out the client's retries while Redis is away.
REDIS_TIMEOUT_S = 2.0


def unavailable(status: str, message: str, **extra: Any) -> web.Response:
    body = {"status": status, **extra, **error_body(message, "service_unavailable", None, 503)}
    return json_response(body, 503)


async def health(request: web.Request) -> web.StreamResponse:
    """200 only when a request can be served end to end now (services/gateway/readiness.py);
    503 naming each missing stage and why."""
    state = request.app[STATE]
    if state.draining:
        return unavailable("draining", "the gateway is shutting down")
    readiness = await read_now(state)
    if isinstance(readiness, str):
        return unavailable("unavailable", readiness, missing=["redis"])
    if not readiness.ready:
        return unavailable(
            "unavailable",
            f"not ready: {readiness.message()}",
            missing=readiness.missing,
            reasons=readiness.reasons,
            instances=readiness.instances,
        )
    return json_response(
        {"status": "ok", "instances": readiness.instances, "inflight": len(state.router.queues)}
    )


async def unready(state: GatewayState) -> str | None:
    """Why a request cannot be served end to end now, as GET /health judges it (None: it
    can): for the gRPC health services, which answer a status and a reason, not a body."""
    if state.draining:
        return "the gateway is shutting down"
    readiness = await read_now(state)
    if isinstance(readiness, str):
        return readiness
    return None if readiness.ready else f"not ready: {readiness.message()}"


async def read_now(state: GatewayState) -> Readiness | str:
    """The stack's readiness as Redis holds it, or why Redis could not say within
    REDIS_TIMEOUT_S: what GET /health and the gRPC health services both judge from."""
    try:
        async with asyncio.timeout(REDIS_TIMEOUT_S):  # keeps a cancel, unlike 3.11's wait_for
            return await read_readiness(state.r, state.settings.detokenizer_partitions)
    except (TimeoutError, *TRANSIENT) as e:
        return f"redis is unreachable: {str(e) or f'no answer within {REDIS_TIMEOUT_S:g}s'}"


class ProbeFailed(Exception):
    """The one-token probe did not come back: `status` says how ("unavailable", "timeout")."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def probe_generate(
    state: GatewayState, parent: str, request: web.BaseRequest | None = None
) -> dict[str, Any]:
    """One greedy token through every service: its latency, ids and rid; raises ProbeFailed
    (and ClientGone when `request`'s client leaves). Shared by HTTP and gRPC health checks."""
    if state.draining:
        raise ProbeFailed("draining", "the gateway is shutting down")
    embed = state.settings.is_embedding  # an embedding server's probe is an embedding
    probe = Job(
        prompt=TextPrompt(text=PROBE_PROMPT),
        sampling=SamplingParams(max_new_tokens=0 if embed else 1, temperature=0.0),
        stream=False,
        rid=f"health-{uuid.uuid4().hex}",
        embed=embed,
    )
    started = time.monotonic()
    tokens: list[int] = []
    try:
        (pending,) = await state.dispatcher.submit([probe], parent, timeout_s=PROBE_TIMEOUT_S)
    except ApiError as e:
        raise ProbeFailed("unavailable", f"the probe was not sent: {e.message}") from e
    try:
        while True:
            reply = await pending.next(request)
            if isinstance(reply, Failure):
                raise ProbeFailed("unavailable", f"the probe failed: {reply.error.message}")
            tokens += reply.token_ids
            if reply.finish_reason is not None:
                break
    except ApiError:  # its deadline passed; closing it aborts it downstream
        raise ProbeFailed("timeout", f"no token came back within {PROBE_TIMEOUT_S:g}s") from None
    except ClientGone:
        pending.abort_reason = "client disconnected"
        raise
    finally:
        pending.close()
    return {
        "status": "ok",
        "latency_s": round(time.monotonic() - started, 4),
        "token_ids": tokens,
        "rid": pending.rid,
    }


async def health_generate(request: web.Request) -> web.StreamResponse:
    """200 with the seconds one greedy token took through every service; 503 saying why not
    (a service refused the probe, or no token came within PROBE_TIMEOUT_S)."""
    try:
        result = await probe_generate(request.app[STATE], traceparent(request), request)
    except ProbeFailed as e:
        return unavailable(e.status, e.message)
    except ClientGone:
        return web.Response(status=499)
    return json_response(result)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_post("/health_generate", health_generate)
