"""What the engine does for a request with a grammar, after each of its tokens lands.

Kept apart from the engine so the unconstrained path stays as it is: every function here is
a no-op for a request without a grammar.
"""

from __future__ import annotations

from services.executor.grammar import GrammarViolation
from services.executor.request import Req
from shared.messages.common import ErrorInfo


def start(req: Req) -> None:
    """Text the grammar forces from the very start joins the prompt's prefill."""
    if req.grammar is None:
        return
    forced = _jump_forward(req)
    req.output_ids += forced
    req.forced_tokens += len(forced)
    if req.grammar.done:
        req.finish = "stop"


def after_token(req: Req, index: int) -> ErrorInfo | None:
    """The grammar takes the sampled token at output `index`: finish "stop" when it is
    complete, else append what it now forces (computed in one extend step, not one step per
    token). An error when the model produced a token the grammar forbids."""
    g = req.grammar
    if g is None or g.done or req.finish == "abort" or index >= len(req.output_ids):
        return None
    token = req.output_ids[index]
    try:
        done = g.accept(token)
    except GrammarViolation as e:
        req.finish = "abort"
        del req.output_ids[index + 1 :]
        return ErrorInfo(status=500, message=f"structured output failed: {e}", type="server_error")
    if done:
        req.finish = "stop"
        req.matched_stop_token = token if token in g.stop_token_ids else None
        del req.output_ids[index + 1 :]  # a token sampled after it, in flight, is dropped
        return None
    if req.finish is not None:
        return None  # out of tokens: finish "length", the output is cut short
    if index < len(req.output_ids) - 1:
        # The next token is already being sampled (overlap): its mask forces the first
        # forced token; ask the engine to jump forward once it is known.
        req.jump_wanted = not req.sampling.return_logprob and g.has_forced_text()
        return None
    req.jump_wanted = False
    forced = _jump_forward(req)
    req.output_ids += forced
    req.forced_tokens += len(forced)
    if g.done:
        req.finish = "stop"
    elif req.all_len >= req.limit_len:
        req.finish = "length"
    return None


def _jump_forward(req: Req) -> list[int]:
    """The tokens the grammar forces next. None for a request that wants logprobs: forced
    tokens are never sampled, so they would have none."""
    assert req.grammar is not None
    if req.sampling.return_logprob:
        return []
    return req.grammar.jump_forward(req.limit_len - req.all_len)
