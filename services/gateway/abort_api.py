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
from services.gateway.errors import ApiError, invalid
from services.gateway.protocol import AbortBody
from services.gateway.responses import json_response
from services.gateway.state import STATE
from shared.bus import TRANSIENT


async def abort_request(request: web.Request) -> web.StreamResponse:
    """`{"rid": ...}` aborts the HTTP call that dispatched that rid, on any gateway (404 when
    none has it in flight for this caller); `{"abort_all": true}` aborts every call in flight
    here (an admin) or the caller's own calls in flight here."""
    dispatcher = request.app[STATE].dispatcher
    who = caller(request)
    body = validation.decode(await request.read(), AbortBody)
    if body.abort_all and body.rid is not None:
        raise invalid("give rid or abort_all, not both", "rid")
    try:
        if body.abort_all:
            inflight = dispatcher.inflight
            rids = tuple(sorted(inflight.calls)) if who.admin else inflight.owned_by(who.owner)
        elif body.rid is None:
            raise invalid("rid is required (or abort_all: true)", "rid")
        else:
            validation.check_rid(body.rid, "rid")
            call = await dispatcher.inflight.lookup(body.rid)
            rids = call.rids if who.admin or call.owner == who.owner else ()
            if not rids:
                raise ApiError(
                    404, f"no request with rid {body.rid!r} is in flight on any gateway", "rid"
                )
        if rids:
            await dispatcher.publish_aborts(rids, "abort_request")
    except TRANSIENT as e:
        raise ApiError(503, f"cannot reach the request bus: {e}") from e
    return json_response({"aborted": list(rids)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/abort_request", abort_request)
