"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web

from services.gateway import input_limits, validation
from services.gateway.access import caller
from services.gateway.embeddings_api import require_mode
from services.gateway.errors import ApiError
from services.gateway.fanout import respond_many
from services.gateway.openai_render import ChatRenderer, CompletionRenderer
from services.gateway.protocol import ChatBody, CompletionBody
from services.gateway.reasoning import splitter_for
from services.gateway.responses import json_response, traceparent
from services.gateway.state import STATE, GatewayState
from services.gateway.tools import PARSERS as TOOL_PARSERS
from shared.bus import TRANSIENT
from shared.service import live_instances


async def _answer(
    request: web.Request,
    jobs: list[validation.Job],
    group: int,
    keep: int,
    renderer: CompletionRenderer | ChatRenderer,
) -> web.StreamResponse:
    """`group` samples of each job (one job per prompt); the `keep` best of each group are
    returned (best_of), all of them otherwise."""
    state = request.app[STATE]
    expanded = [s for job in jobs for s in validation.samples(job, group)]
    if keep < group:  # ranking needs every sample's logprobs, asked for or not
        expanded = [
            replace(j, sampling=msgspec.structs.replace(j.sampling, return_logprob=True))
            for j in expanded
        ]
    owner = caller(request).owner
    pendings = await state.dispatcher.submit(expanded, traceparent(request), owner=owner)
    renderer.id = f"{renderer.id}-{pendings[0].rid}"
    return await respond_many(request, pendings, renderer, jobs[0].stream, group, keep)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    require_mode(state, embeddings=False)
    body = validation.decode(await request.read(), CompletionBody)
    jobs = validation.completion_jobs(body, state.settings.model_name)
    input_limits.check_prompts((j.prompt for j in jobs), state.settings.max_prompt_chars, "prompt")
    renderer = CompletionRenderer(
        "cmpl",
        state.settings.model_name,
        jobs[0].include_usage,
        logprobs=body.logprobs is not None,
        echo=body.echo,
    )
    renderer.continuous_usage = continuous_usage(body)
    group = validation.best_of_count(body)
    return await _answer(request, jobs, group, body.n or 1, renderer)


def continuous_usage(body: CompletionBody | ChatBody) -> bool:
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    require_mode(state, embeddings=False)
    body = validation.decode(await request.read(), ChatBody)
    tool_parser = state.settings.tool_call_parser
    job = validation.chat_job(body, state.settings.model_name, tool_parser)
    input_limits.check_prompts([job.prompt], state.settings.max_prompt_chars, "messages")
    parser = state.settings.reasoning_parser
    renderer = ChatRenderer(
        "chatcmpl",
        state.settings.model_name,
        job.include_usage,
        logprobs=body.logprobs,
        reasoning=splitter_for(parser, body.chat_template_kwargs or {}, body.stream_reasoning)
        if body.separate_reasoning
        else None,
        tools=job.tools,
        tool_parser=TOOL_PARSERS[tool_parser] if tool_parser else None,
    )
    renderer.continuous_usage = continuous_usage(body)
    n = body.n or 1
    return await _answer(request, [job], n, n, renderer)


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
