"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from services.gateway import validation
from services.gateway.errors import ApiError
from services.gateway.protocol import ChatBody, CompletionBody
from services.gateway.responses import Accumulated, json_response, respond, traceparent
from services.gateway.state import STATE, GatewayState
from shared.bus import TRANSIENT
from shared.messages.reply import Delta
from shared.service import live_instances


def usage_body(acc: Accumulated) -> dict[str, Any]:
    u = acc.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class _Base:
    chunk_object = ""  # the "object" of streamed chunks

    def __init__(self, id: str, model: str, include_usage: bool) -> None:
        self.id, self.model, self.include_usage = id, model, include_usage
        self.created = int(time.time())

    def envelope(self, kind: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = self.envelope(self.chunk_object, [choice])
        if self.include_usage:  # OpenAI: every chunk has "usage": null but the last
            out["usage"] = None
        return out

    def head(self) -> list[Any]:
        return []

    def tail(self, acc: Accumulated) -> list[Any]:
        if not self.include_usage:
            return []
        return [{**self.envelope(self.chunk_object, []), "usage": usage_body(acc)}]


class CompletionRenderer(_Base):
    chunk_object = "text_completion"

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def delta(self, d: Delta, acc: Accumulated) -> list[Any]:
        if not d.text and d.finish_reason is None:
            return []
        return [self.chunk(self._choice(d.text, d.finish_reason))]

    def body(self, acc: Accumulated) -> Any:
        choice = self._choice(acc.text, acc.finish_reason)
        return {**self.envelope("text_completion", [choice]), "usage": usage_body(acc)}


class ChatRenderer(_Base):
    chunk_object = "chat.completion.chunk"

    def _choice(self, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def head(self) -> list[Any]:
        return [self.chunk(self._choice({"role": "assistant", "content": ""}, None))]

    def delta(self, d: Delta, acc: Accumulated) -> list[Any]:
        events = []
        if d.text:
            events.append(self.chunk(self._choice({"content": d.text}, None)))
        if d.finish_reason is not None:
            events.append(self.chunk(self._choice({}, d.finish_reason)))
        return events

    def body(self, acc: Accumulated) -> Any:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": acc.text},
            "logprobs": None,
            "finish_reason": acc.finish_reason,
        }
        return {**self.envelope("chat.completion", [choice]), "usage": usage_body(acc)}


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = validation.decode(await request.read(), CompletionBody)
    job = validation.completion_job(body, state.settings.model_name)
    pending = await state.dispatcher.submit(job, traceparent(request))
    model = state.settings.model_name
    renderer = CompletionRenderer(f"cmpl-{pending.rid}", model, job.include_usage)
    return await respond(request, pending, renderer, job.stream)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = validation.decode(await request.read(), ChatBody)
    job = validation.chat_job(body, state.settings.model_name)
    pending = await state.dispatcher.submit(job, traceparent(request))
    model = state.settings.model_name
    renderer = ChatRenderer(f"chatcmpl-{pending.rid}", model, job.include_usage)
    return await respond(request, pending, renderer, job.stream)


async def model_card(state: GatewayState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.settings.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "radixserve",
    }
    try:  # the context length, as the live executors report it
        executors = await live_instances(state.r, "executor")
    except TRANSIENT:
        executors = []
    lengths = [h.executor.context_length for h in executors if h.executor is not None]
    if lengths:
        card["max_model_len"] = min(lengths)
    return card


async def list_models(request: web.Request) -> web.StreamResponse:
    card = await model_card(request.app[STATE])
    return json_response({"object": "list", "data": [card]})


async def get_model(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.settings.model_name:
        raise ApiError(404, f"model {name!r} does not exist", "model")
    return json_response(await model_card(state))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
