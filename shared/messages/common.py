"""Pieces shared by several streams' messages."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """Per-request sampling controls, already validated by the gateway.

    `max_new_tokens` None means "up to the context length"; the tokenizer resolves it.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = None
    # Penalties (vLLM's semantics): repetition over prompt + output, the others over output.
    repetition_penalty: float = 1.0  # logit / p where positive, logit * p where negative
    frequency_penalty: float = 0.0  # minus penalty * times the token was generated
    presence_penalty: float = 0.0  # minus penalty once the token was generated
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    # Log probabilities of the model's raw distribution (before penalties, masks, temperature).
    return_logprob: bool = False  # of each sampled token
    top_logprobs: int = 0  # and of the k most likely tokens at each position
    logprob_start_len: int = -1  # >= 0: also of the prompt tokens from this position on
    # SGLang's stop_regex: the output ends right after the first match (which it keeps)
    stop_regex: list[str] = []
    # SGLang's no_stop_trim: the matched stop string, or the stop token's text, stays in the
    # output (otherwise both are cut, as OpenAI's API does)
    no_stop_trim: bool = False


class HopTimes(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True, frozen=True
):
    """When a request, then its first token, passed each service: unix seconds (wall clocks,
    so hops across hosts are only as exact as their clock sync); 0.0 where not recorded.
    The first three travel in the request's Trace; the executor adds its own to the first
    TokenDelta, the detokenizer its own to the first Delta. Append new hops at the end."""

    gateway_received: float = 0.0  # the gateway took the request, to publish it
    tokenized: float = 0.0  # the tokenizer published it to the scheduler (or grammar)
    routed: float = 0.0  # the scheduler published it to an executor
    executor_inbox: float = 0.0  # the executor's reader handed it to the engine
    first_launched: float = 0.0  # the step that samples its first token was launched
    first_on_host: float = 0.0  # that token reached the host
    executor_published: float = 0.0  # the step's output was published to the detokenizer
    detok_published: float = 0.0  # its first text delta was published to the gateway


class Trace(msgspec.Struct, kw_only=True, frozen=True):
    """What every request carries through every service: its id, deadline and trace context."""

    rid: str
    reply_to: str  # the owning gateway's reply stream
    deadline: float  # unix seconds; past it every service drops the request
    traceparent: str = ""  # W3C trace context of the client request
    hops: HopTimes | None = None  # generation requests: when each service passed it on


class ErrorInfo(msgspec.Struct, kw_only=True, frozen=True):
    """An OpenAI-style error: HTTP status, message, offending parameter, error type."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    # seconds after which a retry may succeed (overload, a service restarting): sent to HTTP
    # clients as `Retry-After`
    retry_after: float | None = None


class JsonSchemaConstraint(msgspec.Struct, tag="json_schema", kw_only=True, frozen=True):
    """Output is one JSON document valid against `schema` (a JSON Schema as JSON text).

    `param` is the request field it came from, as the client spelled it, for error messages.
    """

    schema: str
    param: str = "json_schema"


class RegexConstraint(msgspec.Struct, tag="regex", kw_only=True, frozen=True):
    """Output fully matches `pattern`."""

    pattern: str
    param: str = "regex"


class EbnfConstraint(msgspec.Struct, tag="ebnf", kw_only=True, frozen=True):
    """Output is a sentence of `grammar` (GBNF / xgrammar EBNF, start rule `root`)."""

    grammar: str
    param: str = "ebnf"


class ChoiceConstraint(msgspec.Struct, tag="choice", kw_only=True, frozen=True):
    """Output is exactly one of `choices`."""

    choices: list[str]
    param: str = "choices"


# At most one per request; the grammar service compiles it, the executor enforces it.
Constraint = JsonSchemaConstraint | RegexConstraint | EbnfConstraint | ChoiceConstraint


class AbortRequest(msgspec.Struct, tag="abort", kw_only=True, frozen=True):
    """Stop a request wherever it is: sent by a gateway to rs:tokenize, passed on to rs:schedule
    and to the executor holding it (or by a detokenizer, when a stop string matched)."""

    rid: str
    reason: str = "abort"
