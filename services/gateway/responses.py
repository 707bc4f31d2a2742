"""Pieces of every response: what a request produced so far, JSON bodies, SSE events."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from shared.messages.reply import Delta, TokenLogprob, Usage

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
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    echo_text: str = ""
    hop_ms: dict[str, float] | None = None  # per-stage latency of the first token, once known
    embedding: bytes | None = None  # an embedding request's vector (float32, little-endian)

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.prompt_logprobs += d.prompt_logprobs
        if d.echo_text is not None:
            self.echo_text = d.echo_text
        self.usage = d.usage  # cumulative
        if d.embedding is not None:
            self.embedding = d.embedding
        if d.finish_reason is not None:
            self.finish_reason, self.matched_stop = d.finish_reason, d.matched_stop


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_encode(body), status=status, content_type="application/json", headers=headers
    )


def traceparent(request: web.BaseRequest) -> str:
    """The client's W3C traceparent if well formed, else "" (the dispatcher starts a trace)."""
    return traceparent_of(request.headers.get("traceparent"))


def traceparent_of(given: str | None) -> str:
    """`given` (a traceparent header or gRPC metadata value) if well formed, else ""."""
    given = (given or "").strip().lower()
    return given if _TRACEPARENT.match(given) else ""


def sse_bytes(events: list[Any]) -> bytes:
    """`events` as server-sent events, encoded now: a renderer's objects may hold the
    accumulator's lists, which the next reply extends."""
    return b"".join(b"data: " + _encode(e) + b"\n\n" for e in events)


async def send_events(resp: web.StreamResponse, events: list[Any]) -> None:
    if events:
        await resp.write(sse_bytes(events))
