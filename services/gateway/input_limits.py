"""Size limits on what a client sends, checked before the expensive step they protect.

- The body: refused from `Content-Length` before a byte is read, and while reading a chunked
  body (aiohttp's `client_max_size`, set from the same figure), as a 413.
- The prompt: a prompt with more characters than `max_prompt_chars` cannot fit any context this
  server offers (a token is rarely more than a few characters), so it is refused as a 400 before
  the tokenizer spends seconds on it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from aiohttp import hdrs, web

from services.gateway.errors import ApiError, invalid
from services.gateway.responses import json_response
from services.gateway.state import STATE, GatewaySettings
from shared.messages.tokenize import ChatPrompt, Prompt, TextPrompt

# A prompt's characters per token, generously: real tokenizers average 3 to 5 on text, and a
# token of 32 characters is rare. `--max-prompt-chars` defaults to this times a 128k context.
# The body that carries such a prompt (16 MiB by default) leaves room for JSON escapes and for a
# token-id prompt of the same context (about 7 bytes an id).
CHARS_PER_TOKEN_BOUND = 32
DEFAULT_MAX_PROMPT_CHARS = GatewaySettings.max_prompt_chars
DEFAULT_MAX_REQUEST_BYTES = GatewaySettings.max_body_bytes

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def too_large(limit: int, size: int | None = None) -> ApiError:
    got = f" (Content-Length {size})" if size is not None else ""
    return ApiError(
        413, f"the request body is larger than this server's limit of {limit} bytes{got}"
    )


def check_content_length(length: int | None, limit: int) -> None:
    """A declared length over the limit is refused before reading; a chunked body (no length)
    is capped while it is read."""
    if length is not None and length > limit:
        raise too_large(limit, length)


@web.middleware
async def body_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
    limit = request.app[STATE].settings.max_body_bytes
    try:
        if request.method in (hdrs.METH_POST, hdrs.METH_PUT, hdrs.METH_PATCH):
            check_content_length(request.content_length, limit)
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:  # a chunked body went past client_max_size
        return _refuse(too_large(limit))
    except ApiError as e:
        if e.status != 413:
            raise
        return _refuse(e)


def _refuse(e: ApiError) -> web.StreamResponse:
    """The 413, closing the connection: otherwise the server reads (and drops) the rest of the
    body to keep the connection alive, and the refusal takes as long as the upload."""
    response = json_response(e.body(), e.status)
    response.force_close()
    return response


def prompt_chars(prompt: Prompt) -> int:
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    if isinstance(prompt, ChatPrompt):
        return sum(len(m.content) for m in prompt.messages)
    return 0  # token ids: the body limit bounds them, and the tokenizer counts them exactly


def check_prompts(prompts: Iterable[Prompt], limit: int, param: str) -> None:
    """400 for a prompt no context can hold; `limit` 0 turns the check off."""
    if not limit:
        return
    for prompt in prompts:
        n = prompt_chars(prompt)
        if n > limit:
            raise invalid(
                f"the prompt has {n} characters, more than this server's limit of {limit} "
                f"(no context it serves can hold it)",
                param,
            )
