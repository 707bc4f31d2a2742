"""What the gateway tests share: a running gateway's handles and reading its answers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from services.gateway.state import GatewayState

MODEL = "test-model"


@dataclass
class Running:
    url: str
    state: GatewayState
    runner: web.AppRunner


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """The payloads of a whole SSE body, checking the `data: ...\\n\\n` framing."""
    raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    events: list[Any] = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def wait_until(check: Callable[[], bool], timeout: float = 3.0) -> None:
    until = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < until, "condition not met in time"
        await asyncio.sleep(0.02)
