"""POST /abort_request (SGLang's native endpoint): stop requests wherever they are.

The abort travels the bus like a client disconnect's: the scheduler forwards it to the
executor holding the request, which frees its KV at once, or ends the request when it arrives
if it is still being tokenized or compiled. Either way the request's own HTTP call ends
normally with finish reason "abort", on whichever gateway it runs.

Callers abort only their own requests (the owner recorded at dispatch, services/gateway/
inflight.py); an admin aborts anyone's. Another owner's rid answers the same 404 as an unknown
one, so a caller cannot learn which rids exist.
"""

from __future__ import annotations

from aiohttp import web

from services.gateway import validation
from services.gateway.access import caller
from services.gateway.access_policy import Caller
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import ApiError, invalid
from services.gateway.protocol import AbortBody
from services.gateway.responses import json_response
from services.gateway.state import STATE
from shared.bus import TRANSIENT


async def abort_request(request: web.Request) -> web.StreamResponse:
    """`{"rid": ...}` aborts the HTTP call that dispatched that rid, on any gateway (404 when
    none has it in flight for this caller); `{"abort_all": true}` aborts every call in flight
    here (an admin) or the caller's own calls in flight here."""
    body = validation.decode(await request.read(), AbortBody)
    rids = await abort_calls(request.app[STATE].dispatcher, caller(request), body)
    return json_response({"aborted": list(rids)})


async def abort_calls(dispatcher: Dispatcher, who: Caller, body: AbortBody) -> tuple[str, ...]:
    """Abort what `body` names for `who` (HTTP and gRPC alike): the rids aborted."""
    if body.abort_all and body.rid is not None:
        raise invalid("give rid or abort_all, not both", "rid")
    try:
        if body.abort_all:
            call = dispatcher.inflight.owned_by(None if who.admin else who.owner)
        elif body.rid is None:
            raise invalid("rid is required (or abort_all: true)", "rid")
        else:
            validation.check_rid(body.rid, "rid")
            call = await dispatcher.inflight.lookup(body.rid)
            if not (who.admin or call.owner == who.owner) or not call.rids:
                raise ApiError(
                    404, f"no request with rid {body.rid!r} is in flight on any gateway", "rid"
                )
        if call.rids:
            await dispatcher.publish_aborts(call.bus_ids(), "abort_request")
    except TRANSIENT as e:
        raise ApiError(503, f"cannot reach the request bus: {e}") from e
    return call.rids


def add_routes(app: web.Application) -> None:
    app.router.add_post("/abort_request", abort_request)
