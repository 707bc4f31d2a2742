"""A scripted OpenAI-compatible (and radixserve-native) server on a real port.

Every request is answered with the same `chunks` of text, the first after `first_delay` and
each next one `gap` seconds later, then a usage it reports as configured: metrics measured
against it have known values.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "fake-model"


@dataclass
class Script:
    chunks: list[str] = field(default_factory=lambda: ["Once", " upon", " a", " time", "."])
    first_delay: float = 0.05
    gap: float = 0.02
    prompt_tokens: int = 100
    cached_tokens: int | None = 40  # None: usage without prompt_tokens_details
    report_usage: bool = True
    fail_status: int | None = None  # answer every request with this HTTP error
    reject_response_format: bool = False  # 400 for structured output, as radixserve does today
    error_after_first: bool = False  # an SSE error event after the first chunk

    @property
    def completion_tokens(self) -> int:
        return len(self.chunks)  # one token per chunk


@dataclass
class Served:
    path: str
    body: dict[str, Any]
    received: float  # time.perf_counter()
    finished: float = 0.0
    authorization: str | None = None  # the request's Authorization header


class FakeServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.served: list[Served] = []
        self.in_flight = self.max_in_flight = 0
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            self.app.router.add_post(path, self.generate)
        self._runner = web.AppRunner(self.app)
        self.url = ""

    async def start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        s = self.script
        served = Served(request.path, await request.json(), time.perf_counter())
        served.authorization = request.headers.get("Authorization")
        self.served.append(served)
        if s.fail_status is not None:
            return _error(s.fail_status, "scripted failure")
        if s.reject_response_format and (
            "response_format" in served.body
            or "json_schema" in served.body.get("sampling_params", {})
        ):
            return _error(400, "response_format is not supported yet")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, served)
        finally:
            self.in_flight -= 1
            served.finished = time.perf_counter()

    async def _stream(self, request: web.Request, served: Served) -> web.StreamResponse:
        s = self.script
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text = ""
        for i, chunk in enumerate(s.chunks):
            await asyncio.sleep(s.first_delay if i == 0 else s.gap)
            if s.error_after_first and i == 1:
                await _send(resp, {"error": {"message": "scripted mid-stream failure"}})
                break
            text += chunk
            await _send(resp, self._event(served, chunk, text, i + 1, i + 1 == len(s.chunks)))
        else:
            if s.report_usage and served.path != "/generate":
                await _send(resp, {"choices": [], "usage": self._usage()})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _usage(self) -> dict[str, Any]:
        s = self.script
        usage: dict[str, Any] = {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
        }
        if s.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": s.cached_tokens}
        return usage

    def _event(self, served: Served, chunk: str, text: str, n: int, last: bool) -> dict[str, Any]:
        finish = "length" if last else None
        if served.path == "/v1/completions":
            return {"choices": [{"index": 0, "text": chunk, "finish_reason": finish}]}
        if served.path == "/v1/chat/completions":
            return {"choices": [{"index": 0, "delta": {"content": chunk}, "finish_reason": finish}]}
        meta: dict[str, Any] = {"id": "r"}
        if self.script.report_usage:
            meta["prompt_tokens"], meta["completion_tokens"] = self.script.prompt_tokens, n
            meta["cached_tokens"] = self.script.cached_tokens
        meta["finish_reason"] = {"type": finish, "matched": None} if last else None
        return {"text": text, "output_ids": list(range(n)), "meta_info": meta}


async def _send(resp: web.StreamResponse, event: dict[str, Any]) -> None:
    await resp.write(f"data: {json.dumps(event)}\n\n".encode())


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)
