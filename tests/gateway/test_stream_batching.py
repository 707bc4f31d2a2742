"""A stream that fell behind sends its queued replies in one write (fanout._stream_one). Each
reply's objects must show the request as it stood at that reply, even though the native
renderer's cumulative objects hold the accumulator's token list, which later replies extend."""

from __future__ import annotations

import json
from typing import Any, cast

from aiohttp import web

from services.gateway.fanout import _stream_one
from services.gateway.native_api import NativeRenderer
from services.gateway.responses import Accumulated
from shared.messages.reply import GenerationReply
from tests.gateway.fake_backend import delta


class BehindPending:
    """A Pending whose remaining replies had all queued up before the first was written."""

    def __init__(self, queued: list[GenerationReply]) -> None:
        self.queued = queued

    def ready(self) -> list[GenerationReply]:
        out, self.queued = self.queued, []
        return out

    async def next(self, request: Any = None) -> GenerationReply:
        raise AssertionError("every reply was already queued")


class Sink:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


async def test_replies_sent_together_keep_each_ones_cumulative_ids() -> None:
    first = delta("r", "Hello", [101], 1)
    rest: list[GenerationReply] = [
        delta("r", " world", [102], 2),
        delta("r", "!", [103], 3, finish_reason="stop"),
    ]
    sink = Sink()
    renderer = NativeRenderer(["r"], many=False, logprobs=False, with_text=False)
    await _stream_one(
        cast(web.Request, None),
        cast(Any, BehindPending(rest)),
        renderer,
        cast(web.StreamResponse, sink),
        [Accumulated()],
        first,
        1,
    )
    assert len(sink.writes) == 1  # the queued replies went out together
    events = [json.loads(e[len("data: ") :]) for e in sink.writes[0].decode().split("\n\n") if e]
    assert [(e["text"], e["output_ids"]) for e in events] == [
        ("Hello", [101]),
        ("Hello world", [101, 102]),
        ("Hello world!", [101, 102, 103]),
    ]
