"""POST /v1/responses: one generation, answered as a Response or streamed as its events.

As with chat completions, the first reply is awaited before any header goes out, so a
refusal is a plain JSON error with its status; a failure after the headers is a
`response.failed` event; a vanished client aborts the generation.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from services.gateway import input_limits, validation
from services.gateway.access import caller
from services.gateway.dispatch import ClientGone, Pending, client_gone
from services.gateway.embeddings_api import require_mode
from services.gateway.errors import ApiError
from services.gateway.fanout import collect
from services.gateway.openai_responses.convert import responses_job
from services.gateway.openai_responses.protocol import ResponsesBody
from services.gateway.openai_responses.render import ResponseRenderer
from services.gateway.reasoning import splitter_for
from services.gateway.responses import SSE_HEADERS, Accumulated, json_response, traceparent
from services.gateway.state import STATE
from services.gateway.tools import PARSERS as TOOL_PARSERS
from shared.messages.reply import Delta, Failure, GenerationReply

_encoder = msgspec.json.Encoder()
Event = tuple[str, dict[str, Any]]


async def send(resp: web.StreamResponse, events: list[Event]) -> None:
    if events:
        await resp.write(
            b"".join(
                b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(body) + b"\n\n"
                for kind, body in events
            )
        )


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    require_mode(state, embeddings=False)
    body = validation.decode(await request.read(), ResponsesBody)
    tool_parser = state.settings.tool_call_parser
    job = responses_job(body, state.settings.model_name, tool_parser)
    input_limits.check_prompts([job.prompt], state.settings.max_prompt_chars, "input")
    (pending,) = await state.dispatcher.submit(
        [job], traceparent(request), owner=caller(request).owner
    )
    parser = state.settings.reasoning_parser
    renderer = ResponseRenderer(
        pending.rid,
        state.settings.model_name,
        body,
        splitter_for(parser, body.chat_template_kwargs or {}),
        tools=job.tools,
        tool_parser=TOOL_PARSERS[tool_parser] if tool_parser else None,
    )
    headers = {"X-Request-Id": pending.rid}
    resp: web.StreamResponse | None = None
    try:
        message = await pending.next(request)
        if isinstance(message, Failure):
            raise ApiError.from_info(message.error)
        if not body.stream:
            acc = Accumulated()
            await collect(request, pending, acc, message)
            answer = renderer.final(acc.text, acc.usage, acc.finish_reason)
            return json_response(answer, headers=headers)
        resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
        await send(resp, renderer.head())
        await relay(request, pending, message, renderer, resp)
        await resp.write_eof()
        return resp
    except ApiError as e:
        if resp is None:
            return json_response(e.body(), e.status, {**headers, **e.headers()})
        failed = renderer.response("failed", [])
        failed["error"] = {"code": e.type, "message": e.message}
        await send(resp, [renderer.event("response.failed", response=failed)])
        return resp
    except (ClientGone, ConnectionResetError):
        pending.abort_reason = "client disconnected"
        return resp if resp is not None else web.Response(status=499)
    except asyncio.CancelledError:
        pending.abort_reason = "client disconnected" if client_gone(request) else "gateway stopping"
        raise
    finally:
        pending.close()


async def relay(
    request: web.Request,
    p: Pending,
    message: GenerationReply,
    renderer: ResponseRenderer,
    resp: web.StreamResponse,
) -> None:
    while True:
        if isinstance(message, Failure):
            raise ApiError.from_info(message.error)
        assert isinstance(message, Delta)
        if message.hops is not None:
            p.first_token(message.hops)
        last = message.finish_reason is not None
        events = renderer.delta(message.text, last)
        if last:
            events += renderer.tail(message.usage, message.finish_reason)
        await send(resp, events)
        if last:
            return
        message = await p.next(request)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
