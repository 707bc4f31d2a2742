"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from services.gateway import validation
from services.gateway.errors import ApiError
from services.gateway.fanout import respond_many, total_usage
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

    def _choice(self, text: str, finish: str | None, index: int = 0) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def delta(self, d: Delta, acc: Accumulated) -> list[Any]:
        return self.delta_at(0, d, acc)

    def delta_at(self, index: int, d: Delta, acc: Accumulated) -> list[Any]:
        if not d.text and d.finish_reason is None:
            return []
        return [self.chunk(self._choice(d.text, d.finish_reason, index))]

    def head_many(self, n: int) -> list[Any]:
        return []

    def body(self, acc: Accumulated) -> Any:
        return self.body_many([acc])

    def body_many(self, accs: list[Accumulated]) -> Any:
        choices = [self._choice(a.text, a.finish_reason, i) for i, a in enumerate(accs)]
        return {**self.envelope("text_completion", choices), "usage": usage_body(total_usage(accs))}


class ChatRenderer(_Base):
    chunk_object = "chat.completion.chunk"

    def _choice(self, delta: dict[str, str], finish: str | None, index: int = 0) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def head(self) -> list[Any]:
        return self.head_many(1)

    def head_many(self, n: int) -> list[Any]:
        role = {"role": "assistant", "content": ""}
        return [self.chunk(self._choice(role, None, i)) for i in range(n)]

    def delta(self, d: Delta, acc: Accumulated) -> list[Any]:
        return self.delta_at(0, d, acc)

    def delta_at(self, index: int, d: Delta, acc: Accumulated) -> list[Any]:
        events = []
        if d.text:
            events.append(self.chunk(self._choice({"content": d.text}, None, index)))
        if d.finish_reason is not None:
            events.append(self.chunk(self._choice({}, d.finish_reason, index)))
        return events

    def body(self, acc: Accumulated) -> Any:
        return self.body_many([acc])

    def body_many(self, accs: list[Accumulated]) -> Any:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": a.text},
                "logprobs": None,
                "finish_reason": a.finish_reason,
            }
            for i, a in enumerate(accs)
        ]
        return {**self.envelope("chat.completion", choices), "usage": usage_body(total_usage(accs))}


async def _answer(
    request: web.Request,
    job: validation.Job,
    n: int | None,
    prefix: str,
    renderer_cls: type[CompletionRenderer] | type[ChatRenderer],
) -> web.StreamResponse:
    """One request per sample; a single sample takes the plain path."""
    state = request.app[STATE]
    model = state.settings.model_name
    jobs = validation.samples(job, n)
    parent = traceparent(request)
    pendings = []
    try:
        for j in jobs:
            pendings.append(await state.dispatcher.submit(j, parent))
    except BaseException:
        for p in pendings:
            p.close()
        raise
    renderer = renderer_cls(f"{prefix}-{pendings[0].rid}", model, job.include_usage)
    if len(pendings) == 1:
        return await respond(request, pendings[0], renderer, job.stream)
    return await respond_many(request, pendings, renderer, job.stream)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = validation.decode(await request.read(), CompletionBody)
    job = validation.completion_job(body, state.settings.model_name)
    return await _answer(request, job, body.n, "cmpl", CompletionRenderer)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = validation.decode(await request.read(), ChatBody)
    job = validation.chat_job(body, state.settings.model_name)
    return await _answer(request, job, body.n, "chatcmpl", ChatRenderer)


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
