"""rs:schedule (tokenizer or grammar -> scheduler) and rs:exec:{id} (scheduler -> one executor).

A TokenizedRequest with a constraint goes tokenizer -> rs:grammar -> grammar service ->
rs:schedule; the grammar service fills in `grammar_key` once the compiled grammar is cached.
"""

from __future__ import annotations

import msgspec

from shared.messages.common import AbortRequest, Constraint, SamplingParams, Trace


class TokenizedRequest(msgspec.Struct, tag="tokenized", kw_only=True, frozen=True):
    trace: Trace
    input_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int  # resolved against the context length
    eos_token_ids: list[int]  # the model's end tokens; ignored when sampling.ignore_eos
    detok_stream: str  # where the executor sends this request's tokens
    constraint: Constraint | None = None
    # f"{constants.GRAMMAR_CACHE_PREFIX}:{grammar_key}" holds the compiled constraint; "" until
    # the grammar service has compiled it (and always "" without a constraint).
    grammar_key: str = ""
    # The constraint starts after this token: a reasoning model thinks unconstrained until it
    # generates its think-end marker ("</think>"), and the grammar applies from the next token
    # on (the tokenizer sets it, see GenerateRequest.think_end). None: from the first token.
    think_end_id: int | None = None
    # A request resumed after its executor was lost (see services/scheduler/failover.py):
    # the output tokens its client has already been sent, which the next executor prefills
    # after the prompt and does not send again; how many times it was resumed; and the
    # executors it was lost from, never routed to again.
    resume_ids: list[int] = []
    resumes: int = 0
    avoid: list[str] = []
    embed: bool = False  # pool the prompt into an embedding (see GenerateRequest.embed)
    dimensions: int = 0  # and keep its first n values (see GenerateRequest.dimensions)


class FlushCache(msgspec.Struct, tag="flush_cache", kw_only=True, frozen=True):
    """Ask an executor to drop every cached, unused prefix."""

    reply_to: str = ""
    rid: str = ""


class RequestDone(msgspec.Struct, tag="done", kw_only=True, frozen=True):
    """From a detokenizer: the request's final answer went to its gateway. The scheduler
    forgets its route (nothing is left to resume if its executor is lost)."""

    rid: str


ScheduleMessage = TokenizedRequest | AbortRequest | FlushCache | RequestDone
ExecutorMessage = TokenizedRequest | AbortRequest | FlushCache
