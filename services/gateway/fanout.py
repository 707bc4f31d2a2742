"""Answering an OpenAI request with `n` samples: one request per sample on the bus, merged
into one response whose `choices[i]` is sample i (streamed chunks carry their index).

Usage counts the prompt once and every sample's completion tokens, as OpenAI does; cached
prompt tokens are the most any sample took from the cache (the samples arrive together, the
first computes the prompt and the others reuse it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from aiohttp import web

from services.gateway.dispatch import ClientGone, Pending, client_gone
from services.gateway.errors import ApiError
from services.gateway.responses import DONE, SSE_HEADERS, Accumulated, json_response, send_events
from shared.messages.reply import Delta, Failure, ReplyMessage, Usage

log = logging.getLogger(__name__)


class ManyRenderer(Protocol):
    def head_many(self, n: int) -> list[Any]: ...
    def delta_at(self, index: int, d: Delta, acc: Accumulated) -> list[Any]: ...
    def tail(self, acc: Accumulated) -> list[Any]: ...
    def body_many(self, accs: list[Accumulated]) -> Any: ...


def total_usage(accs: list[Accumulated]) -> Accumulated:
    first = accs[0].usage
    merged = Accumulated()
    merged.usage = Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(a.usage.completion_tokens for a in accs),
        cached_tokens=max(a.usage.cached_tokens for a in accs),
    )
    return merged


async def respond_many(
    request: web.Request, pendings: list[Pending], renderer: ManyRenderer, stream: bool
) -> web.StreamResponse:
    """Like responses.respond, over several samples; always closes every pending."""
    headers = {"X-Request-Id": pendings[0].rid}
    accs = [Accumulated() for _ in pendings]
    resp: web.StreamResponse | None = None
    try:
        firsts = await asyncio.gather(*(p.next(request) for p in pendings))
        for m in firsts:
            if isinstance(m, Failure):
                raise ApiError.from_info(m.error)
        if not stream:
            for acc, p, m in zip(accs, pendings, firsts, strict=True):
                await _collect(request, p, acc, m)
            return json_response(renderer.body_many(accs), headers=headers)
        resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
        await send_events(resp, renderer.head_many(len(pendings)))
        await _stream_many(request, pendings, renderer, resp, accs, firsts)
        await resp.write(DONE)
        await resp.write_eof()
        return resp
    except ApiError as e:
        return json_response(e.body(), e.status, headers)
    except (ClientGone, ConnectionResetError):
        for p in pendings:
            p.abort_reason = "client disconnected"
        return resp if resp is not None else web.Response(status=499)
    except asyncio.CancelledError:
        reason = "client disconnected" if client_gone(request) else "gateway stopping"
        for p in pendings:
            p.abort_reason = reason
        raise
    finally:
        for p in pendings:
            p.close()


async def _collect(
    request: web.Request, p: Pending, acc: Accumulated, message: ReplyMessage
) -> None:
    while True:
        if isinstance(message, Failure):
            raise ApiError.from_info(message.error)
        acc.add(message)
        if message.finish_reason is not None:
            return
        message = await p.next(request)


async def _stream_many(
    request: web.Request,
    pendings: list[Pending],
    renderer: ManyRenderer,
    resp: web.StreamResponse,
    accs: list[Accumulated],
    firsts: list[ReplyMessage],
) -> None:
    """Relay every sample's replies as they come; the first error ends the stream."""
    queue: asyncio.Queue[tuple[int, ReplyMessage | ApiError]] = asyncio.Queue()

    async def pump(i: int, p: Pending, first: ReplyMessage) -> None:
        message: ReplyMessage = first
        while True:
            await queue.put((i, message))
            if isinstance(message, Failure) or message.finish_reason is not None:
                return
            try:
                message = await p.next(request)
            except ApiError as e:  # the deadline passed
                await queue.put((i, e))
                return

    tasks = [
        asyncio.create_task(pump(i, p, m))
        for i, (p, m) in enumerate(zip(pendings, firsts, strict=True))
    ]
    try:
        left = len(pendings)
        while left:
            i, message = await queue.get()
            if isinstance(message, ApiError):
                await send_events(resp, [message.body()])
                return
            if isinstance(message, Failure):
                await send_events(resp, [ApiError.from_info(message.error).body()])
                return
            accs[i].add(message)
            events = renderer.delta_at(i, message, accs[i])
            if message.finish_reason is not None:
                left -= 1
                if not left:
                    events += renderer.tail(total_usage(accs))
            await send_events(resp, events)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
