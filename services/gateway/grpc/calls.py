"""What the HTTP middleware gives every HTTP call, for one RPC: the shutdown and readiness
gates, the caller's key (`authorization: Bearer <key>` metadata) checked against the route the
RPC stands for, the per-key in-flight budget, the client's deadline, and any ApiError answered
as its gRPC status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from services.gateway.access_policy import Caller
from services.gateway.errors import ApiError
from services.gateway.grpc.codes import message, status_code, trailers
from services.gateway.ready_gate import UNGATED, check_ready
from services.gateway.state import GatewayState


def metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


def timeout_s(context: grpc.aio.ServicerContext, state: GatewayState) -> float:
    """The client's deadline (a gRPC deadline becomes the request's own), capped by
    --request-timeout."""
    left = context.time_remaining()
    limit = state.settings.request_timeout_s
    return limit if left is None else max(0.001, min(limit, left))


async def abort(context: grpc.aio.ServicerContext, e: ApiError) -> None:
    """Ends the RPC with `e`'s status (raises)."""
    await context.abort(status_code(e.status), message(e), trailers(e))


@asynccontextmanager
async def rpc(
    state: GatewayState,
    context: grpc.aio.ServicerContext,
    route: str,
    budgeted: bool = False,
    gated: bool = True,
) -> AsyncIterator[Caller]:
    """One RPC that stands for HTTP `route` (for the access rules): yields its caller; an
    ApiError raised inside becomes the RPC's status. A `gated` RPC (one that stands for a POST)
    is refused while the stack has not yet been ready, as HTTP's POSTs are; a generation
    (`budgeted`) counts against the caller's key."""
    try:
        if state.draining:
            raise ApiError(503, "the gateway is shutting down", retry_after=1.0)
        if gated and route not in UNGATED:
            await check_ready(state)
        who = state.access.identify(metadata(context, "authorization"))
        state.access.authorize(route, who)
        if budgeted:
            state.key_budget.acquire(who.owner)
        try:
            yield who
        finally:
            if budgeted:
                state.key_budget.release(who.owner)
    except ApiError as e:
        await abort(context, e)
