"""Answering one HTTP request from the replies of one or more bus requests: a batch of
prompts, each with `group` samples (OpenAI `n` / `best_of`, native `n`), merged into one
response whose `choices[i]` is job i (streamed chunks carry their index).

The first reply of every job is awaited before any header is sent, so an early Failure is a
plain JSON error with its status; a Failure or a timeout after the headers becomes an SSE
error event; every stream ends with `data: [DONE]`; a vanished client aborts every job.

Usage counts each prompt once and every sample's completion tokens, as OpenAI does; cached
prompt tokens are, per prompt, the most any of its samples took from the cache (the samples
arrive together, the first computes the prompt and the others reuse it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from aiohttp import web

from services.gateway.dispatch import ClientGone, Pending, client_gone
from services.gateway.errors import ApiError
from services.gateway.logprob_format import cumulative_logprob
from services.gateway.responses import (
    DONE,
    SSE_HEADERS,
    Accumulated,
    json_response,
    send_events,
    sse_bytes,
)
from shared.messages.reply import Delta, Failure, GenerationReply, Usage

log = logging.getLogger(__name__)


class ManyRenderer(Protocol):
    def head_many(self, n: int) -> list[Any]:
        """SSE events sent right after the headers."""
        ...

    def delta_at(self, index: int, d: Delta, acc: Accumulated) -> list[Any]:
        """SSE events for one delta of job `index` (`acc` already includes it)."""
        ...

    def tail(self, usage: Usage) -> list[Any]:
        """SSE events after the last job's final delta, before [DONE]."""
        ...

    def body_many(self, accs: list[Accumulated], usage: Usage) -> Any:
        """The non-streaming response."""
        ...


def total_usage(accs: list[Accumulated], group: int = 1) -> Usage:
    groups = [accs[i : i + group] for i in range(0, len(accs), group)]
    return Usage(
        prompt_tokens=sum(g[0].usage.prompt_tokens for g in groups),
        completion_tokens=sum(a.usage.completion_tokens for a in accs),
        cached_tokens=sum(max(a.usage.cached_tokens for a in g) for g in groups),
    )


def best_of(accs: list[Accumulated], group: int, keep: int) -> list[Accumulated]:
    """The `keep` samples of each group with the highest cumulative logprob, best first."""
    if keep >= group:
        return accs
    out = []
    for i in range(0, len(accs), group):
        ranked = sorted(accs[i : i + group], key=lambda a: -cumulative_logprob(a.logprobs))
        out += ranked[:keep]
    return out


async def respond_many(
    request: web.Request,
    pendings: list[Pending],
    renderer: ManyRenderer,
    stream: bool,
    group: int = 1,
    keep: int | None = None,
) -> web.StreamResponse:
    """Answer `request` from every pending's replies; always closes every pending. With
    `keep` < `group` (best_of, never streamed) only the best samples are returned."""
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
                await collect(request, p, acc, m)
            chosen = best_of(accs, group, group if keep is None else keep)
            body = renderer.body_many(chosen, total_usage(accs, group))
            return json_response(body, headers=headers)
        resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
        await send_events(resp, renderer.head_many(len(pendings)))
        await _stream_many(request, pendings, renderer, resp, accs, firsts, group)
        await resp.write(DONE)
        await resp.write_eof()
        return resp
    except ApiError as e:
        return json_response(e.body(), e.status, {**headers, **e.headers()})
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


async def collect(
    request: web.Request, p: Pending, acc: Accumulated, message: GenerationReply
) -> None:
    while True:
        if isinstance(message, Failure):
            raise ApiError.from_info(message.error)
        if message.hops is not None:
            acc.hop_ms = p.first_token(message.hops)
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
    firsts: list[GenerationReply],
    group: int,
) -> None:
    """Relay every sample's replies as they come; the first error ends the stream."""
    if len(pendings) == 1:
        return await _stream_one(request, pendings[0], renderer, resp, accs, firsts[0], group)
    queue: asyncio.Queue[tuple[int, GenerationReply | ApiError]] = asyncio.Queue()

    async def pump(i: int, p: Pending, first: GenerationReply) -> None:
        message: GenerationReply = first
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
            if message.hops is not None:
                accs[i].hop_ms = pendings[i].first_token(message.hops)
            accs[i].add(message)
            events = renderer.delta_at(i, message, accs[i])
            if message.finish_reason is not None:
                left -= 1
                if not left:
                    events += renderer.tail(total_usage(accs, group))
            await send_events(resp, events)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream_one(
    request: web.Request,
    p: Pending,
    renderer: ManyRenderer,
    resp: web.StreamResponse,
    accs: list[Accumulated],
    message: GenerationReply,
    group: int,
) -> None:
    """One sample's stream, relayed without a pump task between it and the response. The
    replies that queued up while the last write was out go out together in one write, so
    a gateway that falls behind catches up instead of paying a wakeup and a write each."""
    acc = accs[0]
    while True:
        # each reply's events are encoded before the next reply extends the accumulator
        # (the native renderer's cumulative objects share its token list)
        chunks: list[bytes] = []
        for m in [message, *p.ready()]:
            if isinstance(m, Failure):
                chunks.append(sse_bytes([ApiError.from_info(m.error).body()]))
                await resp.write(b"".join(chunks))
                return
            if m.hops is not None:
                acc.hop_ms = p.first_token(m.hops)
            acc.add(m)
            events = renderer.delta_at(0, m, acc)
            if m.finish_reason is not None:
                events += renderer.tail(total_usage(accs, group))
                chunks.append(sse_bytes(events))
                await resp.write(b"".join(chunks))
                return
            chunks.append(sse_bytes(events))
        if any(chunks):
            await resp.write(b"".join(chunks))
        try:
            message = await p.next(request)
        except ApiError as e:  # the deadline passed
            await send_events(resp, [e.body()])
            return
