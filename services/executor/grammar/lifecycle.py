"""What the engine does for a request with a grammar, after each of its tokens lands.

Kept apart from the engine so the unconstrained path stays as it is: every function here is
a no-op for a request without a grammar.

A reasoning model's grammar may start dormant (`RequestGrammar.sleep_until`): while it thinks,
its tokens are only compared with the think-end token; the one after that is the grammar's
first, and from there on everything below applies as to any grammar.
"""

from __future__ import annotations

from services.executor.grammar.matcher import GrammarViolation, RequestGrammar
from services.executor.request import Req
from shared.messages.common import ErrorInfo


def start(req: Req) -> None:
    """Text the grammar forces from the very start joins the prompt's prefill (nothing for
    a grammar that waits for the thinking part to end)."""
    if req.grammar is None or req.grammar.dormant:
        return
    forced = jump_forward(req)
    req.output_ids += forced
    req.forced_tokens += len(forced)
    if req.grammar.done:
        req.finish = "stop"
    elif req.all_len >= req.limit_len:  # the forced text took the whole budget: nothing
        req.finish = "length"  # may be sampled after it


def resume(req: Req) -> None:
    """A request resumed from a lost executor: the grammar takes the output the client
    already has, then forces what follows it, as at the start. Raises GrammarViolation for a
    token it does not allow."""
    g = req.grammar
    if g is None:
        return
    begin = 0
    if g.dormant:
        if g.wake_token not in req.output_ids:
            return  # still thinking
        begin = req.output_ids.index(g.wake_token) + 1
        g.wake(begin)
    for token in req.output_ids[begin:]:
        if g.accept(token):
            req.finish = "stop"
            req.matched_stop_token = token if token in g.stop_token_ids else None
            return
    start(req)


def after_token(req: Req, index: int) -> ErrorInfo | None:
    """The grammar takes the sampled token at output `index` (just landed): finish "stop"
    when it is complete, else append what it now forces (computed in one extend step, not
    one step per token). An error when the model produced a token the grammar forbids."""
    g = req.grammar
    if g is None:
        return None
    if g.dormant:  # thinking: the grammar starts after the think-end token
        if index < len(req.output_ids) and req.output_ids[index] == g.wake_token:
            g.wake(index + 1)
            _advance(req, g, index)
        return None
    if index == g.forced_at:  # the in-flight token a jump-forward decided has landed
        g.forced_landed()
    if g.done or req.finish == "abort" or index >= len(req.output_ids):
        return None
    if g.failure is not None:
        return _abort(req, index, g.failure)
    if index < g.offset + len(g.accepted):
        return None  # a forced token, accepted when it was appended (see below)
    try:
        return _after_token(req, g, index)
    except Exception as e:  # GrammarViolation, or the matcher itself failing: this request only
        reason = str(e) if isinstance(e, GrammarViolation) else f"{type(e).__name__}: {e}"
        return _abort(req, index, reason)


def _abort(req: Req, index: int, reason: str) -> ErrorInfo:
    req.finish = "abort"
    del req.output_ids[index + 1 :]
    req.pending = 0
    return ErrorInfo(status=500, message=f"structured output failed: {reason}", type="server_error")


def _after_token(req: Req, g: RequestGrammar, index: int) -> ErrorInfo | None:
    token = req.output_ids[index]
    done = g.accept(token)
    if done:
        req.finish = "stop"
        req.matched_stop_token = token if token in g.stop_token_ids else None
        req.pending = 0  # a token sampled after it, in flight, is dropped
        return None
    _advance(req, g, index)
    return None


def _advance(req: Req, g: RequestGrammar, index: int) -> None:
    """After the grammar took the token at output `index` (or woke after it): the output
    is cut short if out of tokens, else the text the grammar now forces is appended."""
    if req.finish is not None:
        return  # out of tokens: finish "length", the output is cut short
    # With overlap the next token is launched but not sampled yet (its mask waits for this
    # token). Forced text then starts at that token: its mask will allow only the first
    # forced token, so its value is known here and the rest can follow it at once, without
    # holding back the next step for it.
    in_flight = req.pending > 0
    assert req.pending <= 1 and index == len(req.output_ids) - 1, "at most one token in flight"
    forced = jump_forward(req, in_flight)
    if in_flight and forced:
        # The in-flight token's value is known now: it joins the output (and no longer
        # counts as pending); when it lands, `Req.land` only checks it off.
        req.pending -= 1
        g.forced_at = len(req.output_ids)  # the jump set `forced_next` to forced[0]
        req.output_ids += forced
        req.forced_tokens += len(forced) - 1
    else:
        req.output_ids += forced
        req.forced_tokens += len(forced)
    if g.done:
        req.finish = "stop"
        req.pending = 0  # (only a grammar complete as it woke: a token in flight is dropped)
    elif req.all_len >= req.limit_len and not req.pending:
        req.finish = "length"  # (a token still in flight decides this when it lands)


def jump_forward(req: Req, in_flight: bool = False) -> list[int]:
    """The tokens the grammar forces next. None for a request that wants logprobs: forced
    tokens are never sampled, so they would have none."""
    assert req.grammar is not None
    if req.sampling.return_logprob:
        return []
    room = req.limit_len - req.all_len + in_flight  # the in-flight token's place is counted
    return req.grammar.jump_forward(room, in_flight)
