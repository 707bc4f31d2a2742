"""rs:reply:{gateway} — text deltas and errors for the gateway instance that owns the request."""

from __future__ import annotations

import msgspec

from shared.messages.common import ErrorInfo


class Usage(msgspec.Struct, kw_only=True, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Delta(msgspec.Struct, tag="delta", kw_only=True, frozen=True, omit_defaults=True):
    """New text (possibly empty) and tokens of one request; `finish_reason` on the last one."""

    rid: str
    text: str
    token_ids: list[int]
    usage: Usage
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None  # the stop string or stop token that ended it


class Failure(msgspec.Struct, tag="failure", kw_only=True, frozen=True):
    rid: str
    error: ErrorInfo


ReplyMessage = Delta | Failure
