"""SGLang's native generation endpoint: POST /generate."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway import input_limits, validation
from services.gateway.access import caller
from services.gateway.embeddings_api import require_mode
from services.gateway.fanout import respond_many
from services.gateway.logprob_format import native_logprobs
from services.gateway.protocol import GenerateBody
from services.gateway.responses import Accumulated, traceparent
from services.gateway.state import STATE
from shared.messages.reply import Delta, Usage


class NativeRenderer:
    """SGLang's shapes. Every streamed object is cumulative (the whole text and ids so far);
    a batch or `n` > 1 answers a list, and its streamed objects carry their `index`."""

    def __init__(
        self, rids: list[str], many: bool, logprobs: bool, with_text: bool, hops: bool = False
    ) -> None:
        self.rids, self.many = rids, many
        self.logprobs, self.with_text = logprobs, with_text
        self.hops = hops  # report the first token's per-stage latency on the last object

    def _object(self, index: int, acc: Accumulated) -> dict[str, Any]:
        finish = None
        if acc.finish_reason is not None:
            finish = {"type": acc.finish_reason, "matched": acc.matched_stop}
        meta: dict[str, Any] = {
            "id": self.rids[index],
            "prompt_tokens": acc.usage.prompt_tokens,
            "completion_tokens": acc.usage.completion_tokens,
            "cached_tokens": acc.usage.cached_tokens,
            "finish_reason": finish,
        }
        if self.hops and acc.finish_reason is not None:
            meta["hop_latency_ms"] = acc.hop_ms
        if self.logprobs:
            out, out_top = native_logprobs(acc.logprobs, self.with_text)
            inp, inp_top = native_logprobs(acc.prompt_logprobs, self.with_text)
            meta.update(
                output_token_logprobs=out,
                output_top_logprobs=out_top,
                input_token_logprobs=inp,
                input_top_logprobs=inp_top,
            )
        obj: dict[str, Any] = {"text": acc.text, "output_ids": acc.token_ids, "meta_info": meta}
        if self.many:
            obj["index"] = index
        return obj

    def head_many(self, n: int) -> list[Any]:
        return []

    def delta_at(self, index: int, d: Delta, acc: Accumulated) -> list[Any]:
        if not d.text and not d.token_ids and d.finish_reason is None:
            return []
        return [self._object(index, acc)]

    def tail(self, usage: Usage) -> list[Any]:
        return []

    def body_many(self, accs: list[Accumulated], usage: Usage) -> Any:
        objects = [self._object(i, a) for i, a in enumerate(accs)]
        return objects if self.many else objects[0]


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    require_mode(state, embeddings=False)
    body = validation.decode(await request.read(), GenerateBody)
    jobs, many = validation.native_jobs(body)
    input_limits.check_prompts((j.prompt for j in jobs), state.settings.max_prompt_chars, "text")
    parent = traceparent(request)
    pendings = await state.dispatcher.submit(jobs, parent, owner=caller(request).owner)
    renderer = NativeRenderer(
        [p.rid for p in pendings],
        many,
        body.return_logprob,
        body.return_text_in_logprobs,
        hops=body.return_hop_latency,
    )
    return await respond_many(request, pendings, renderer, body.stream)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
