"""Answering one request from its replies: a JSON body, or an SSE stream.

The endpoint-specific shapes come from a `Renderer`; this module owns the order of events:
the first reply is awaited before any header is sent (so an early Failure is a plain JSON
error with its status), a Failure or a timeout after the headers becomes an SSE error event,
every stream ends with `data: [DONE]`, and a vanished client aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from aiohttp import web

from services.gateway.dispatch import ClientGone, Pending, client_gone
from services.gateway.errors import ApiError
from shared.messages.reply import Delta, Failure, Usage

log = logging.getLogger(__name__)

_encode = msgspec.json.encode
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell proxies not to buffer the stream
}
DONE = b"data: [DONE]\n\n"


@dataclass
class Accumulated:
    """Everything a request produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    usage: Usage = field(default_factory=lambda: Usage(prompt_tokens=0, completion_tokens=0))
    finish_reason: str | None = None
    matched_stop: str | int | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.usage = d.usage  # cumulative
        if d.finish_reason is not None:
            self.finish_reason, self.matched_stop = d.finish_reason, d.matched_stop


class Renderer(Protocol):
    """The response shapes of one endpoint."""

    def head(self) -> list[Any]:
        """SSE events sent right after the headers."""
        ...

    def delta(self, d: Delta, acc: Accumulated) -> list[Any]:
        """SSE events for one delta (`acc` already includes it)."""
        ...

    def tail(self, acc: Accumulated) -> list[Any]:
        """SSE events after the final delta, before [DONE]."""
        ...

    def body(self, acc: Accumulated) -> Any:
        """The non-streaming response."""
        ...


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_encode(body), status=status, content_type="application/json", headers=headers
    )


def traceparent(request: web.BaseRequest) -> str:
    """The client's W3C traceparent if well formed, else a fresh one."""
    given = request.headers.get("traceparent", "").strip().lower()
    if _TRACEPARENT.match(given):
        return given
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


async def respond(
    request: web.Request, pending: Pending, renderer: Renderer, stream: bool
) -> web.StreamResponse:
    """Answer `request` from `pending`'s replies; always closes `pending`."""
    headers = {"X-Request-Id": pending.rid}
    resp: web.StreamResponse | None = None
    try:
        first = await pending.next(request)
        if isinstance(first, Failure):
            raise ApiError.from_info(first.error)
        acc = Accumulated()
        if not stream:
            message: Delta | Failure = first
            while True:
                if isinstance(message, Failure):
                    raise ApiError.from_info(message.error)
                acc.add(message)
                if message.finish_reason is not None:
                    return json_response(renderer.body(acc), headers=headers)
                message = await pending.next(request)
        resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
        await send_events(resp, renderer.head())
        await _stream(request, pending, renderer, resp, acc, first)
        await resp.write(DONE)
        await resp.write_eof()
        return resp
    except ApiError as e:  # before any header went out (later ones are SSE events)
        return json_response(e.body(), e.status, headers)
    except (ClientGone, ConnectionResetError):
        pending.abort_reason = "client disconnected"
        log.info("client of %s went away; aborting it", pending.rid)
        return resp if resp is not None else web.Response(status=499)
    except asyncio.CancelledError:  # the client went away, or the shutdown timeout passed
        gone = client_gone(request)
        pending.abort_reason = "client disconnected" if gone else "gateway stopping"
        raise
    finally:
        pending.close()


async def _stream(
    request: web.Request,
    pending: Pending,
    renderer: Renderer,
    resp: web.StreamResponse,
    acc: Accumulated,
    message: Delta | Failure,
) -> None:
    """Relay replies as SSE events until the final one; errors become an error event."""
    try:
        while True:
            if isinstance(message, Failure):
                await send_events(resp, [ApiError.from_info(message.error).body()])
                return
            acc.add(message)
            events = renderer.delta(message, acc)
            if message.finish_reason is not None:
                await send_events(resp, events + renderer.tail(acc))
                return
            await send_events(resp, events)
            message = await pending.next(request)
    except ApiError as e:  # the deadline passed mid-stream
        await send_events(resp, [e.body()])


async def send_events(resp: web.StreamResponse, events: list[Any]) -> None:
    if events:
        await resp.write(b"".join(b"data: " + _encode(e) + b"\n\n" for e in events))
