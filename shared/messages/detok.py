"""rs:detok:{partition} — what a detokenizer instance needs to turn tokens into text deltas."""

from __future__ import annotations

import msgspec

from shared.messages.common import ErrorInfo, HopTimes, SamplingParams, Trace


class DetokRegister(msgspec.Struct, tag="register", array_like=True, kw_only=True, frozen=True):
    """Sent by the tokenizer before the request goes to the scheduler, so it is always first.

    Array-like like every message on this stream: msgspec unions cannot mix the two layouts.
    """

    trace: Trace
    prompt_tokens: int
    sampling: SamplingParams
    echo_text: str | None = None  # the prompt as text, sent back first (OpenAI `echo`)


class LogprobBlock(msgspec.Struct, array_like=True, gc=False, kw_only=True, frozen=True):
    """Log probabilities of consecutive tokens: `logprobs[i]` is that of `token_ids[i]`, and
    `top_ids[i]` / `top_logprobs[i]` the most likely tokens at that position (empty unless
    asked for). `start` is the position of the first token in its sequence."""

    start: int
    token_ids: list[int]
    logprobs: list[float | None]  # None: a prompt's first token (nothing predicts it)
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []


class TokenDelta(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True, frozen=True
):
    """One request's new tokens in one step. `finish` is set on its last delta."""

    rid: str
    token_ids: list[int]
    finish: str | None = None  # "stop" | "length" | "abort"
    cached_tokens: int = 0
    matched_stop_token: int | None = None
    logprobs: LogprobBlock | None = None  # of `token_ids`, when the request asked
    prompt_logprobs: LogprobBlock | None = None  # on the first delta, when the request asked
    hops: HopTimes | None = None  # on the first delta: the trace's stamps and the executor's
    # An embedding request's final delta: the pooled, normalised vector as float32 values,
    # little-endian (a fraction of the size of a list of floats on the wire).
    embedding: bytes | None = None


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
    # unix seconds the executor's sender published it, set only on a step that carries a
    # first token (a delta with hops): nil, one byte, on the others
    published: float | None = None


class RequestFailed(msgspec.Struct, tag="failed", array_like=True, kw_only=True, frozen=True):
    """A request ended with an error after registration (queue full, executor lost, ...)."""

    rid: str
    error: ErrorInfo


class RequestAborted(msgspec.Struct, tag="aborted", array_like=True, kw_only=True, frozen=True):
    """An abort reached the scheduler before the request did: it ends, with finish reason
    "abort" and no output, as if the executor had aborted it before its first token."""

    rid: str
    reason: str = "abort"


class Reroute(msgspec.Struct, tag="reroute", array_like=True, kw_only=True, frozen=True):
    """From the scheduler: `executor`, which held the request, is lost. The detokenizer drops
    any later tokens of it from that executor and sends the request back to the scheduler
    with the output its client already has (`TokenizedRequest.resume_ids`), to be continued
    on another executor. `request` is the routed TokenizedRequest, msgpack-encoded as the
    scheduler stored it."""

    rid: str
    executor: str
    request: bytes


DetokMessage = DetokRegister | StepOutput | RequestFailed | RequestAborted | Reroute
