"""rs:reply:{gateway} — text deltas and errors for the gateway instance that owns the request,
and the answers to its tokenize / detokenize calls. Every message names its request's rid."""

from __future__ import annotations

import msgspec

from shared.messages.common import ErrorInfo, HopTimes


class Usage(msgspec.Struct, kw_only=True, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TopLogprob(msgspec.Struct, array_like=True, gc=False, kw_only=True, frozen=True):
    token_id: int
    token: str  # the token's text on its own
    bytes: list[int]  # its UTF-8 bytes (a token may hold part of a character)
    logprob: float


class TokenLogprob(msgspec.Struct, array_like=True, gc=False, kw_only=True, frozen=True):
    """One token of the prompt or output with its log probability (None for a prompt's first
    token, which nothing predicts) and the most likely alternatives at its position."""

    token_id: int
    token: str
    bytes: list[int]
    logprob: float | None
    top: list[TopLogprob] = []


class Delta(msgspec.Struct, tag="delta", kw_only=True, frozen=True, omit_defaults=True):
    """New text (possibly empty) and tokens of one request; `finish_reason` on the last one."""

    rid: str
    text: str
    token_ids: list[int]
    usage: Usage
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] = []  # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprob] = []  # on the first delta, when the request asked
    echo_text: str | None = None  # the prompt's text, on the first delta (OpenAI `echo`)
    hops: HopTimes | None = None  # on the first delta: when each service passed it on
    embedding: bytes | None = None  # an embedding request's vector (see TokenDelta.embedding)


class Failure(msgspec.Struct, tag="failure", kw_only=True, frozen=True):
    rid: str
    error: ErrorInfo


class TokenizeResult(msgspec.Struct, tag="tokenized", kw_only=True, frozen=True):
    """The answer to a TokenizeRequest."""

    rid: str
    token_ids: list[int]
    max_model_len: int  # the tokenizer's context length


class DetokenizeResult(msgspec.Struct, tag="detokenized", kw_only=True, frozen=True):
    """The answer to a DetokenizeRequest."""

    rid: str
    text: str


# What a generation's replies can be (Pending.next narrows to this).
GenerationReply = Delta | Failure
ReplyMessage = Delta | Failure | TokenizeResult | DetokenizeResult
