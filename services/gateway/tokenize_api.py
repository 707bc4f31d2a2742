"""POST /tokenize and POST /detokenize (SGLang's and vLLM's): answered by a tokenizer replica
through the bus, since only the tokenizer service loads the tokenizer."""

from __future__ import annotations

from aiohttp import web

from services.gateway import input_limits, validation
from services.gateway.errors import ApiError, invalid
from services.gateway.protocol import DetokenizeBody, TokenizeBody
from services.gateway.responses import json_response
from services.gateway.state import STATE, GatewayState
from shared.messages.common import Trace
from shared.messages.reply import DetokenizeResult, ReplyMessage, TokenizeResult
from shared.messages.tokenize import ChatPrompt, DetokenizeRequest, TextPrompt, TokenizeRequest

CALL_TIMEOUT_S = 30.0  # a tokenizer answers in milliseconds; this only bounds a dead bus


def tokenize_prompt(body: TokenizeBody) -> TextPrompt | ChatPrompt:
    given = [name for name in ("text", "prompt", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        found = " and ".join(given) if given else "none"
        raise invalid(f"give exactly one of text, prompt and messages (got {found})", "text")
    if body.messages is not None:
        chat = validation.chat_prompt(body.messages)
        return ChatPrompt(messages=chat.messages, add_generation_prompt=body.add_generation_prompt)
    text = body.text if body.text is not None else body.prompt
    assert text is not None
    return TextPrompt(text=text, add_special_tokens=body.add_special_tokens)


def _unexpected(reply: ReplyMessage) -> ApiError:
    return ApiError(500, f"unexpected reply {type(reply).__name__}", type="server_error")


def _timeout(state: GatewayState) -> float:
    return min(state.settings.request_timeout_s, CALL_TIMEOUT_S)


async def tokenize(request: web.Request) -> web.StreamResponse:
    """`{"tokens": [...], "count": N, "max_model_len": M}`; no length check (that is what a
    client asks it for)."""
    body = validation.decode(await request.read(), TokenizeBody)
    reply = await tokenize_call(request.app[STATE], body)
    return json_response(
        {
            "tokens": reply.token_ids,
            "count": len(reply.token_ids),
            "max_model_len": reply.max_model_len,
        }
    )


async def tokenize_call(state: GatewayState, body: TokenizeBody) -> TokenizeResult:
    """A tokenizer replica's answer to `body` (HTTP and gRPC alike)."""
    validation.check_model(body.model, state.settings.model_name)
    prompt = tokenize_prompt(body)
    param = "messages" if body.messages is not None else "text" if body.text else "prompt"
    input_limits.check_prompts([prompt], state.settings.max_prompt_chars, param)

    def build(trace: Trace) -> TokenizeRequest:
        return TokenizeRequest(trace=trace, prompt=prompt)

    reply = await state.dispatcher.call(build, _timeout(state))
    if not isinstance(reply, TokenizeResult):
        raise _unexpected(reply)
    return reply


async def detokenize(request: web.Request) -> web.StreamResponse:
    """`{"text": ...}`; an id outside the vocabulary is a 400 naming `tokens[i]`."""
    body = validation.decode(await request.read(), DetokenizeBody)
    return json_response({"text": await detokenize_call(request.app[STATE], body)})


async def detokenize_call(state: GatewayState, body: DetokenizeBody) -> str:
    validation.check_model(body.model, state.settings.model_name)
    ids = validation.token_ids(body.tokens, "tokens")

    def build(trace: Trace) -> DetokenizeRequest:
        return DetokenizeRequest(
            trace=trace, token_ids=ids, skip_special_tokens=body.skip_special_tokens
        )

    reply = await state.dispatcher.call(build, _timeout(state))
    if not isinstance(reply, DetokenizeResult):
        raise _unexpected(reply)
    return reply.text


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
