"""SGLang-style native endpoints: POST /generate and GET /health."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway import validation
from services.gateway.errors import error_body
from services.gateway.protocol import GenerateBody
from services.gateway.responses import Accumulated, json_response, respond, traceparent
from services.gateway.state import STATE
from shared.bus import TRANSIENT
from shared.messages.reply import Delta
from shared.service import live_instances

# The services a request passes through: /health is ok only when each has a live instance.
PIPELINE = ("tokenizer", "grammar", "scheduler", "executor", "detokenizer")


class NativeRenderer:
    """Every streamed object is cumulative: the whole text and ids so far, as SGLang sends."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def _object(self, acc: Accumulated) -> dict[str, Any]:
        finish = None
        if acc.finish_reason is not None:
            finish = {"type": acc.finish_reason, "matched": acc.matched_stop}
        return {
            "text": acc.text,
            "output_ids": acc.token_ids,
            "meta_info": {
                "id": self.rid,
                "prompt_tokens": acc.usage.prompt_tokens,
                "completion_tokens": acc.usage.completion_tokens,
                "cached_tokens": acc.usage.cached_tokens,
                "finish_reason": finish,
            },
        }

    def head(self) -> list[Any]:
        return []

    def delta(self, d: Delta, acc: Accumulated) -> list[Any]:
        if not d.text and not d.token_ids and d.finish_reason is None:
            return []
        return [self._object(acc)]

    def tail(self, acc: Accumulated) -> list[Any]:
        return []

    def body(self, acc: Accumulated) -> Any:
        return self._object(acc)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = validation.decode(await request.read(), GenerateBody)
    job = validation.native_job(body)
    pending = await state.dispatcher.submit(job, traceparent(request))
    return await respond(request, pending, NativeRenderer(pending.rid), job.stream)


async def health(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]

    def unavailable(status: str, message: str, **extra: Any) -> web.Response:
        body = {"status": status, **extra, **error_body(message, "service_unavailable", None, 503)}
        return json_response(body, 503)

    if state.draining:
        return unavailable("draining", "the gateway is shutting down")
    try:
        await state.r.ping()
        counts = {name: len(await live_instances(state.r, name)) for name in PIPELINE}
    except TRANSIENT as e:
        return unavailable("unavailable", f"redis is unreachable: {e}", missing=["redis"])
    missing = [name for name, n in counts.items() if n == 0]
    if missing:
        message = f"no live instance of: {', '.join(missing)}"
        return unavailable("unavailable", message, missing=missing, instances=counts)
    return json_response(
        {"status": "ok", "instances": counts, "inflight": len(state.router.queues)}
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
