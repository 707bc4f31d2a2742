"""The access middleware: applies services/gateway/access_policy.py to every request and
remembers the caller for the handlers (`caller(request)`).

Order of the checks: a cross-site browser request (403), the key (401/403), the body's
Content-Type (415), then the caller's in-flight budget on generation routes (429).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from services.gateway.access_policy import (
    BUDGETED_PATHS,
    Caller,
    Role,
    check_content_type,
    check_site,
)
from services.gateway.state import STATE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CALLER = web.RequestKey("caller", Caller)
_OPEN_CALLER = Caller(Role.ADMIN, "")


def caller(request: web.Request) -> Caller:
    """Who sent `request` (an admin when the middleware did not run: no access control)."""
    return request.get(CALLER, _OPEN_CALLER)


@web.middleware
async def access_control(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    check_site(request.headers.get("Sec-Fetch-Site"))
    who = state.access.identify(request.headers.get("Authorization"))
    state.access.authorize(request.path, who)
    content_type = request.headers.get("Content-Type")
    check_content_type(request.method, request.path, content_type, request.body_exists)
    request[CALLER] = who
    if not (request.method == "POST" and request.path in BUDGETED_PATHS):
        return await handler(request)
    state.key_budget.acquire(who.owner)
    try:
        return await handler(request)
    finally:
        state.key_budget.release(who.owner)
