"""One RPC's generation: its jobs dispatched exactly as an HTTP call's are (prompt limits,
admission, the in-flight registry under the caller's key, the client's deadline as the
requests' own, its traceparent), then their replies merged and accumulated per sample."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.gateway import input_limits
from services.gateway.access_policy import Caller
from services.gateway.dispatch import Pending
from services.gateway.grpc.calls import metadata, timeout_s
from services.gateway.grpc.streams import merged
from services.gateway.responses import Accumulated, traceparent_of
from services.gateway.state import GatewayState
from services.gateway.validation import Job
from shared.messages.reply import Delta


async def dispatch(
    state: GatewayState,
    context: grpc.aio.ServicerContext,
    who: Caller,
    jobs: list[Job],
    prompt_param: str,
) -> list[Pending]:
    input_limits.check_prompts(
        (j.prompt for j in jobs), state.settings.max_prompt_chars, prompt_param
    )
    parent = traceparent_of(metadata(context, "traceparent"))
    return await state.dispatcher.submit(
        jobs, parent, timeout_s=timeout_s(context, state), owner=who.owner
    )


async def replies(pendings: list[Pending]) -> AsyncIterator[tuple[int, Delta, Accumulated]]:
    """(sample index, its new delta, everything it produced so far) until every sample has
    finished; deltas that carry nothing (a request's admission) are not passed on, so no
    message is sent for them. Leaving early (an error, a cancelled RPC) aborts the
    unfinished ones."""
    accs = [Accumulated() for _ in pendings]
    async for i, d in merged(pendings):
        if d.hops is not None:  # the first token: its per-stage latency joins the gateway's
            accs[i].hop_ms = pendings[i].first_token(d.hops)
        accs[i].add(d)
        if d.token_ids or d.text or d.finish_reason is not None or d.prompt_logprobs:
            yield i, d, accs[i]


async def collect(pendings: list[Pending]) -> list[Accumulated]:
    """Every sample's whole result."""
    accs = [Accumulated() for _ in pendings]
    async for i, _, acc in replies(pendings):
        accs[i] = acc
    return accs
