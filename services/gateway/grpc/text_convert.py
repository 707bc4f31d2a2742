"""radixserve's own gRPC messages (shared/grpc_api/radixserve.proto) <-> the gateway's bodies
and replies. Pure: requests become the same msgspec bodies /generate, /tokenize and
/abort_request decode, so they are validated (and refused) by the same code."""

from __future__ import annotations

from typing import Any

from services.gateway import validation
from services.gateway.grpc.fields import set_fields
from services.gateway.protocol import (
    AbortBody,
    ChatMessageBody,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
)
from services.gateway.responses import Accumulated
from services.gateway.validation import Job
from shared.grpc_api import radixserve_pb2 as pb
from shared.messages.reply import Delta, TokenLogprob


def _sampling(fields: dict[str, Any]) -> dict[str, Any]:
    s = dict(fields.get("sampling_params", {}))
    if "logit_bias" in s:  # /generate's keys are token ids written as strings
        s["logit_bias"] = {str(k): v for k, v in s["logit_bias"].items()}
    return s


def generate_body(req: pb.GenerateRequest) -> GenerateBody:
    fields = set_fields(req)
    if "input_ids" in fields:
        fields["input_ids"] = fields["input_ids"].get("ids", [])
    fields["sampling_params"] = _sampling(fields)
    return validation.convert(fields, GenerateBody)


def generate_jobs(req: pb.GenerateRequest, stream: bool) -> list[Job]:
    body = generate_body(req)
    body.stream = stream
    jobs, _ = validation.native_jobs(body)
    return jobs


class _Chat(GenerateBody, kw_only=True):
    messages: list[ChatMessageBody]


def chat_jobs(req: pb.ChatRequest, stream: bool) -> list[Job]:
    fields = set_fields(req)
    fields["sampling_params"] = _sampling(fields)
    fields.setdefault("messages", [])
    body = validation.convert(fields, _Chat)
    body.stream = stream
    return validation.native_chat_jobs(body.messages, body)


def tokenize_body(req: pb.TokenizeRequest) -> TokenizeBody:
    fields = set_fields(req)
    if "messages" in fields:
        fields["messages"] = fields["messages"].get("messages", [])
    return validation.convert(fields, TokenizeBody)


def detokenize_body(req: pb.DetokenizeRequest) -> DetokenizeBody:
    fields = set_fields(req)
    fields.setdefault("tokens", [])
    return validation.convert(fields, DetokenizeBody)


def abort_body(req: pb.AbortRequest) -> AbortBody:
    return validation.convert(set_fields(req), AbortBody)


# -- replies ----------------------------------------------------------------------------------
def token_logprobs(entries: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,  # None (unset) for a prompt's first token
            text=e.token,
            top=[
                pb.TopLogprob(token_id=t.token_id, logprob=t.logprob, text=t.token) for t in e.top
            ],
        )
        for e in entries
    ]


def finish(reason: str | None, matched: str | int | None) -> pb.Finish | None:
    if reason is None:
        return None
    if isinstance(matched, str):
        return pb.Finish(reason=reason, matched_text=matched)
    if isinstance(matched, int):
        return pb.Finish(reason=reason, matched_token_id=matched)
    return pb.Finish(reason=reason)


def usage(acc: Accumulated) -> pb.Usage:
    u = acc.usage
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
    )


def chunk(index: int, rid: str, d: Delta, acc: Accumulated) -> pb.GenerateChunk:
    """One delta of sample `index` (`acc` already includes it)."""
    return pb.GenerateChunk(
        index=index,
        rid=rid,
        text=d.text,
        token_ids=d.token_ids,
        logprobs=token_logprobs(d.logprobs),
        prompt_logprobs=token_logprobs(d.prompt_logprobs),
        usage=usage(acc),
        finish=finish(d.finish_reason, d.matched_stop),
    )


def choice(index: int, rid: str, acc: Accumulated) -> pb.Choice:
    return pb.Choice(
        index=index,
        rid=rid,
        text=acc.text,
        output_ids=acc.token_ids,
        finish=finish(acc.finish_reason, acc.matched_stop),
        usage=usage(acc),
        logprobs=token_logprobs(acc.logprobs),
        prompt_logprobs=token_logprobs(acc.prompt_logprobs),
    )
