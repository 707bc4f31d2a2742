"""rs:detok:{partition} — what a detokenizer instance needs to turn tokens into text deltas."""

from __future__ import annotations

import msgspec

from shared.messages.common import ErrorInfo, SamplingParams, Trace


class DetokRegister(msgspec.Struct, tag="register", array_like=True, kw_only=True, frozen=True):
    """Sent by the tokenizer before the request goes to the scheduler, so it is always first.

    Array-like like every message on this stream: msgspec unions cannot mix the two layouts.
    """

    trace: Trace
    prompt_tokens: int
    sampling: SamplingParams


class TokenDelta(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True, frozen=True
):
    """One request's new tokens in one step. `finish` is set on its last delta."""

    rid: str
    token_ids: list[int]
    finish: str | None = None  # "stop" | "length" | "abort"
    cached_tokens: int = 0
    matched_stop_token: int | None = None


class StepOutput(
    msgspec.Struct,
    tag="step",
    array_like=True,
    omit_defaults=True,
    gc=False,
    kw_only=True,
    frozen=True,
):
    """One message per executor step per partition, carrying every request's new tokens."""

    executor: str
    step: int
    deltas: list[TokenDelta]


class RequestFailed(msgspec.Struct, tag="failed", array_like=True, kw_only=True, frozen=True):
    """A request ended with an error after registration (queue full, executor lost, ...)."""

    rid: str
    error: ErrorInfo


DetokMessage = DetokRegister | StepOutput | RequestFailed
