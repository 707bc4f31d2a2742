"""One request's grammar state: an xgrammar matcher over the output tokens it accepted.

Synchronous and free of I/O. A matcher's state is a function of the tokens it accepted
(`accepted`), so retraction (recomputing a request from its tokens) needs nothing; dropping
tokens needs `rollback(n)`, and `rebuild(tokens)` replays a token list from scratch.

What the batch's mask filler (masks.py) reads of it, all public and none consumed by reading:

- `forced_next`: set while the token of the step in flight is already decided (jump-forward
  found it forced after that step was launched): its mask allows that token alone. The
  engine clears it when that token lands (`forced_landed`).
- `state_mask`: the mask of the current state, when `done`'s check already computed it.
- `dormant`: the request is still thinking (see `sleep_until`): no mask, no jump-forward,
  its tokens are not the grammar's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from services.executor.grammar.vocab import GrammarVocab

if TYPE_CHECKING:
    from services.executor.grammar.jump_forward import JumpForward


class GrammarViolation(ValueError):
    """A token the request's grammar does not allow reached `accept` (its row was not masked,
    or it was sampled from a row with nothing allowed). The request should fail with a 500."""


@dataclass
class GrammarStats:
    """Counters of one executor since start, for its heartbeat."""

    requests: int = 0  # matchers created
    masks: int = 0  # bitmask rows filled
    accepted_tokens: int = 0  # sampled tokens accepted
    jump_forward_tokens: int = 0  # forced tokens appended (never sampled; see BatchPolicy)
    jump_forward_refused: int = 0  # forced strings not taken (tokenization would not round-trip)


class RequestGrammar:
    """One request's grammar state over the output tokens it accepted.

    `done` turns True when the grammar is complete and allows nothing but a stop token (or
    accepted one): the request must then finish with finish_reason "stop". A stop token is
    allowed only where the grammar accepts what came before it.
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab: GrammarVocab,
        stats: GrammarStats,
        jumper: JumpForward,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.vocab, self.stats, self.jumper = vocab, stats, jumper
        self.matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(stop_token_ids) or None
        )
        self.stop_token_ids = tuple(self.matcher.stop_token_ids)
        self.accepted: list[int] = []  # every token accepted, sampled and forced, in order
        self.done = False
        # Why the matcher failed (an exception while filling this request's mask): the request
        # fails when its token lands; the batch it shares goes on.
        self.failure: str | None = None
        self.state_mask: torch.Tensor | None = None  # [1, words]: this state's mask, if known
        self._mask_buffer: torch.Tensor | None = None
        self.forced_next: int | None = None  # the in-flight step must sample this token
        self.forced_at = -1  # output index of that token
        # A reasoning model's grammar waits, dormant, for the think-end token (`wake_token`);
        # `offset` is the output index of the grammar's first token (0 unless it waited).
        self.dormant = False
        self.wake_token = -1
        self.offset = 0
        stats.requests += 1

    # -- thinking first ----------------------------------------------------------------------
    def sleep_until(self, token: int) -> None:
        """The request thinks first: the grammar stays dormant (the output unconstrained)
        until `token`, the think-end marker, is generated; it constrains from the next token."""
        assert not self.accepted, "a grammar that took tokens cannot wait for thinking"
        self.dormant, self.wake_token = True, token

    def wake(self, offset: int) -> None:
        """The marker was generated at output `offset - 1`: the grammar starts at `offset`."""
        self.dormant, self.offset = False, offset
        self.changed()

    # -- tokens ------------------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance over a sampled token; True when the request must now finish ("stop").
        Raises GrammarViolation for a token the grammar does not allow here."""
        assert not self.done, "accept after the grammar finished"
        if not self.matcher.accept_token(token):
            raise GrammarViolation(
                f"token {token} ({self.vocab.token_bytes[token]!r}) is not allowed after "
                f"{len(self.accepted)} accepted tokens"
            )
        self.accepted.append(token)
        self.stats.accepted_tokens += 1
        self.changed()
        return self.done

    def jump_forward(self, limit: int, in_flight: bool = False) -> list[int]:
        """The tokens the grammar now forces, at most `limit`, already accepted (see
        jump_forward.py). With `in_flight`, the first of them is the token of the step in
        flight: `forced_next` holds it until it lands."""
        taken = self.jumper.forced(self, limit, in_flight)
        if in_flight and taken:
            self.forced_next = taken[0]
        return taken

    def forced_landed(self) -> None:
        """The in-flight token `forced_next` named reached the host."""
        self.forced_next, self.forced_at = None, -1

    def rollback(self, n: int) -> None:
        """Forget the last n accepted tokens."""
        assert 0 <= n <= len(self.accepted), f"cannot roll back {n} of {len(self.accepted)}"
        if n == 0:
            return
        self.forced_landed()
        self.matcher.rollback(n)
        del self.accepted[-n:]
        self.done = False
        self.changed()

    def rebuild(self, tokens: Sequence[int]) -> None:
        """Reset and replay `tokens` (what the request's output holds)."""
        self.matcher.reset()
        self.forced_landed()
        self.accepted = []
        self.done = False
        self.changed()
        for t in tokens:
            if self.done:
                raise GrammarViolation(f"token {t} after the grammar finished")
            self.accept(t)

    def changed(self) -> None:
        """Recompute `done` after the state moved; keep the mask computed for it."""
        self.state_mask = None
        if self.matcher.is_terminated():
            self.done = True
            return
        if not self.matcher.is_completed():
            self.done = False
            return
        # Complete: done unless some non-stop token may still follow.
        if self._mask_buffer is None:
            self._mask_buffer = xgr.allocate_token_bitmask(1, self.vocab.vocab_size)
        self.matcher.fill_next_token_bitmask(self._mask_buffer, 0)
        self.state_mask = self._mask_buffer
        allowed = self._mask_buffer[0] & self.vocab.non_stop_bits(self.stop_token_ids)
        self.done = not bool(allowed.any())
