"""POST /v1/embeddings (OpenAI's), served when the stack runs with --is-embedding.

Each input goes through the same path as a prompt (tokenizer, scheduler, an executor) as a
prefill-only request whose final hidden states the executor pools into a normalised vector
(services/executor/sampling/pooling.py); the detokenizer passes the vector through. A
generation server answers this endpoint with a 400, and an embedding server answers the
generation endpoints with one (`require_mode`).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import msgspec
import numpy as np
from aiohttp import web

from services.gateway import input_limits, validation
from services.gateway.access import caller
from services.gateway.errors import ApiError
from services.gateway.fanout import collect
from services.gateway.responses import Accumulated, json_response, traceparent
from services.gateway.state import STATE, GatewayState
from services.gateway.validation.common import check_model, invalid
from services.gateway.validation.completions import completion_prompts
from shared.messages.common import SamplingParams
from shared.messages.reply import Failure


class EmbeddingBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`input`: a string, a list of strings, a list of token ids, or a list of token-id lists
    (each string or id list is one embedding)."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, as OpenAI's; not used


def require_mode(state: GatewayState, embeddings: bool) -> None:
    """A 400 when the endpoint is not of the kind this server serves."""
    if state.settings.is_embedding and not embeddings:
        raise ApiError(
            400,
            "this server serves an embedding model (--is-embedding): use POST /v1/embeddings",
            "model",
        )
    if embeddings and not state.settings.is_embedding:
        raise ApiError(
            400,
            "this server generates text; start it with --is-embedding to serve /v1/embeddings",
            "model",
        )


def embedding_jobs(body: EmbeddingBody, served_model: str) -> list[validation.Job]:
    check_model(body.model, served_model)
    if body.dimensions is not None and body.dimensions < 1:
        raise invalid(f"dimensions must be at least 1, got {body.dimensions}", "dimensions")
    return [
        validation.Job(
            prompt=p,
            sampling=SamplingParams(max_new_tokens=0),
            stream=False,
            api="embeddings",
            embed=True,
            dimensions=body.dimensions or 0,
        )
        for p in completion_prompts(body.input, "input")
    ]


def embedding_body(accs: list[Accumulated], model: str, encoding: str) -> dict[str, Any]:
    data = []
    for i, acc in enumerate(accs):
        assert acc.embedding is not None, "an embedding request ended without its vector"
        vector: Any
        if encoding == "base64":  # OpenAI's: the float32 values' bytes, little-endian
            vector = base64.b64encode(acc.embedding).decode()
        else:
            vector = np.frombuffer(acc.embedding, dtype="<f4").tolist()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    prompt_tokens = sum(a.usage.prompt_tokens for a in accs)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


async def embeddings(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    require_mode(state, embeddings=True)
    body = validation.decode(await request.read(), EmbeddingBody)
    jobs = embedding_jobs(body, state.settings.model_name)
    input_limits.check_prompts((j.prompt for j in jobs), state.settings.max_prompt_chars, "input")
    owner = caller(request).owner
    pendings = await state.dispatcher.submit(jobs, traceparent(request), owner=owner)
    accs = [Accumulated() for _ in pendings]
    try:
        firsts = await asyncio.gather(*(p.next(request) for p in pendings))
        for acc, p, m in zip(accs, pendings, firsts, strict=True):
            if isinstance(m, Failure):
                raise ApiError.from_info(m.error)
            await collect(request, p, acc, m)
    except ApiError as e:
        return json_response(e.body(), e.status, e.headers())
    finally:
        for p in pendings:
            p.close()
    return json_response(embedding_body(accs, state.settings.model_name, body.encoding_format))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
