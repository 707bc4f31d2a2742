"""Whether a request may enter the engine, as a pure function: a new `Req`, or the failure
that ends it at once. Nothing here touches the batch."""

from __future__ import annotations

from dataclasses import dataclass

from services.executor.grammar import lifecycle
from services.executor.grammar.backend import GrammarBackend
from services.executor.request import Req
from shared.hops import stamp_hops
from shared.messages.common import ErrorInfo
from shared.messages.schedule import TokenizedRequest


@dataclass(frozen=True)
class Limits:
    """What the engine can take."""

    kv_slots: int  # the KV pool's size
    vocab_size: int  # the model's embedding rows
    context_length: int
    pooling: str | None = None  # --is-embedding: every request is pooled this way
    dimensions: tuple[int, ...] = ()  # what an embedding may be shortened to (Matryoshka)


def admit(
    msg: TokenizedRequest,
    seq: int,
    submitted: float,
    limits: Limits,
    grammars: GrammarBackend | None,
) -> Req | ErrorInfo:
    """The request as the engine holds it (its grammar started: text the grammar forces at
    the start is already in its output, and a request that grammar completes is finished),
    or why it cannot run. `seq`: its arrival order; `submitted`: when it reached the inbox."""
    if msg.embed != (limits.pooling is not None):
        serves = "embeddings (--is-embedding)" if limits.pooling else "text generation"
        return ErrorInfo(
            status=400,
            message=f"this executor serves {serves}, not "
            + ("embeddings" if msg.embed else "text generation"),
            param="model",
        )
    need = len(msg.input_ids) + msg.max_new_tokens
    if need > limits.kv_slots:
        return ErrorInfo(
            status=400,
            message=(
                f"the prompt ({len(msg.input_ids)} tokens) plus max_tokens "
                f"({msg.max_new_tokens}) needs {need} KV slots; this executor has "
                f"{limits.kv_slots}"
            ),
            param="max_tokens",
        )
    # The tokenizer checks ids against its own vocabulary; a model whose embedding is
    # smaller would index out of range and take the whole batch down with it.
    ids = msg.input_ids
    if ids and (min(ids) < 0 or max(ids) >= limits.vocab_size):  # C loops, on every request
        bad = next(t for t in ids if not 0 <= t < limits.vocab_size)
        return ErrorInfo(
            status=400,
            message=f"input_ids holds token id {bad}, outside this model's vocabulary "
            f"[0, {limits.vocab_size})",
            param="input_ids",
        )
    if msg.dimensions and msg.dimensions not in limits.dimensions:
        if not limits.dimensions:
            message = "dimensions is not supported by this model (it declares no Matryoshka "
            message += "dimensions: is_matryoshka or matryoshka_dimensions in its config)"
        elif len(limits.dimensions) > 16:  # any length up to the hidden size
            message = f"dimensions must be in [1, {limits.dimensions[-1]}], got {msg.dimensions}"
        else:
            message = f"dimensions must be one of {list(limits.dimensions)}, got {msg.dimensions}"
        return ErrorInfo(status=400, message=message, param="dimensions")
    req = Req.from_message(msg, seq, limits.context_length)
    if msg.embed:
        req.pooling, req.dimensions = limits.pooling, msg.dimensions
    req.hops = stamp_hops(req.hops, executor_inbox=submitted)
    if req.exhausted and not req.prefill_only:  # resumed with its whole output: only the
        req.finish = "length"  # ending is left to send
    if not msg.grammar_key:
        return req
    if grammars is None:
        return ErrorInfo(
            status=500, message="this executor serves no grammars", type="server_error"
        )
    try:
        req.grammar = grammars.new_request(msg.grammar_key, msg.eos_token_ids)
    except KeyError:
        return ErrorInfo(
            status=503, message="the request's grammar is not loaded; retry", type="server_error"
        )
    except Exception as e:  # the matcher refused to start: this request fails, alone
        return ErrorInfo(
            status=500,
            message=f"structured output failed: cannot start the grammar matcher: "
            f"{type(e).__name__}: {e}",
            type="server_error",
        )
    if msg.think_end_id is not None:  # a reasoning model thinks first, unconstrained
        req.grammar.sleep_until(msg.think_end_id)
    try:
        lifecycle.resume(req) if msg.resume_ids else lifecycle.start(req)
    except Exception as e:
        return ErrorInfo(
            status=500,
            message=f"structured output failed: {type(e).__name__}: {e}",
            type="server_error",
        )
    return req
