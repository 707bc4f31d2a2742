"""Grammar-constrained decoding in the executor: one xgrammar matcher per request and
jump-forward over text the grammar forces (the batch's masks: grammar_masks.py).

Synchronous and free of I/O: compiled grammars come from a callable (`GrammarCache.get`) that
the executor's async shell filled before the request reached the engine.

The life of a constrained request, as the engine drives it:

    g = grammars.new_request(msg.grammar_key, msg.eos_token_ids)   # when the request is added
    forced = g.jump_forward(limit)          # before prefill too: forced text joins the prompt
    rows = fill_bitmask(grammars_of_sampling_rows, bitmask)        # while the forward pass runs
    apply_bitmask(logits, bitmask, rows)                           # before sampling
    done = g.accept(token)                  # each sampled token; True -> finish "stop"
    forced = g.jump_forward(limit)          # tokens to append now, computed in one extend

A matcher's state is a function of the tokens it accepted (`g.accepted`), so retraction
(recomputing a request from its tokens) needs nothing; dropping tokens needs `rollback(n)`,
and `rebuild(tokens)` replays a token list from scratch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from shared.grammar import GrammarTokenizer

JUMP_CACHE_ENTRIES = 65536  # memoised forced strings per executor, then the memo starts over


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


class GrammarVocab:
    """What every matcher of one executor shares: the tokenizer, each token's bytes, which
    tokens may merge with the text that follows them, and stop-token bit patterns."""

    def __init__(self, tok: GrammarTokenizer) -> None:
        self.tok = tok
        self.vocab_size: int = tok.info.vocab_size
        self.words = (self.vocab_size + 31) // 32  # int32 words per bitmask row
        self.special = frozenset(tok.info.special_token_ids)
        self.token_bytes: list[bytes] = list(tok.info.decoded_vocab)
        # A token is "extendable" when a longer token starts with its bytes: canonical
        # tokenization could merge it with whatever text follows it. In sorted order the
        # strings a string prefixes come right after it.
        ordered = sorted({b for i, b in enumerate(self.token_bytes) if b and i not in self.special})
        longer = {a for a, b in itertools.pairwise(ordered) if b.startswith(a)}
        self.extendable = [
            b in longer and i not in self.special for i, b in enumerate(self.token_bytes)
        ]
        self._non_stop: dict[tuple[int, ...], torch.Tensor] = {}
        # (last accepted token or -1, forced text) -> its consistent tokens (see
        # RequestGrammar.jump_forward). Forced strings repeat across the requests of a schema
        # (keys, ", "), and two tokenizer calls per lookup would cost ~100 us each time: at
        # batch 64 more host time per step than the forward pass takes.
        self._jump_tokens: dict[tuple[int, str], list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tok.tokenizer.encode(text, add_special_tokens=False))

    def consistent_tokens(self, prev: int, text: str) -> list[int]:
        """The tokens of `text` when they spell exactly its bytes and, after token `prev`
        (-1: none), re-tokenize as `prev` plus them; else []. Memoised."""
        key = (prev, text)
        ids = self._jump_tokens.get(key)
        if ids is None:
            if len(self._jump_tokens) >= JUMP_CACHE_ENTRIES:
                self._jump_tokens.clear()
            ids = self._jump_tokens[key] = self._consistent_tokens(prev, text)
        return ids

    def _consistent_tokens(self, prev: int, text: str) -> list[int]:
        ids = self.encode(text)
        data = text.encode()
        if any(t in self.special or t >= len(self.token_bytes) for t in ids):
            return []
        if b"".join(self.token_bytes[t] for t in ids) != data:
            return []  # e.g. a SentencePiece tokenizer adding a prefix space
        if prev >= 0:
            try:
                joined = (self.token_bytes[prev] + data).decode()
            except UnicodeDecodeError:
                return []
            if self.encode(joined) != [prev, *ids]:
                return []
        return ids

    def non_stop_bits(self, stop_token_ids: tuple[int, ...]) -> torch.Tensor:
        """[words] int32: every bit set except the stop tokens'."""
        bits = self._non_stop.get(stop_token_ids)
        if bits is None:
            words = np.full(self.words, 0xFFFFFFFF, dtype=np.uint32)
            for t in stop_token_ids:
                words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
            bits = torch.from_numpy(words.view(np.int32))
            self._non_stop[stop_token_ids] = bits
        return bits


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
        stop_token_ids: Sequence[int] = (),
        jump: bool = True,
    ) -> None:
        self.vocab, self.stats = vocab, stats
        self.jump = jump  # False: jump_forward never appends (--disable-jump-forward)
        self.matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(stop_token_ids) or None
        )
        self.stop_token_ids = tuple(self.matcher.stop_token_ids)
        self.accepted: list[int] = []  # every token accepted, sampled and forced, in order
        self.done = False
        # Why the matcher failed (an exception while filling this request's mask): the request
        # fails when its token lands; the batch it shares goes on.
        self.failure: str | None = None
        self._row: torch.Tensor | None = None  # [1, words] the next mask, when computed early
        self._row_valid = False
        # A token already accepted that the step in flight must sample: its mask allows only
        # it (jump-forward decided it after that step was launched).
        self._forced_next: int | None = None
        stats.requests += 1

    # -- masks -------------------------------------------------------------------------------
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (a CPU int32 [rows, words])."""
        if not self.fill_cached(bitmask, row):
            self.matcher.fill_next_token_bitmask(bitmask, row)
            self.stats.masks += 1

    def fill_cached(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write bitmask[row] without the matcher when the mask is already known: the one
        token a jump-forward decided, or the mask computed for this state."""
        if self._forced_next is not None:
            t, self._forced_next = self._forced_next, None
            bitmask[row].zero_()
            bitmask[row, t >> 5] = _bit(t)
        elif self.done:
            raise AssertionError("a finished grammar has no next token")
        elif self._row_valid and self._row is not None:
            bitmask[row].copy_(self._row[0])
        else:
            return False
        self.stats.masks += 1
        return True

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
        self._changed()
        return self.done

    def jump_forward(self, limit: int, in_flight: bool = False) -> list[int]:
        """Tokens of the text the grammar now forces, at most `limit`, already accepted: the
        caller appends them to the output and computes them in one extend step. Empty when
        nothing is forced, jump-forward is off, or the forced text does not re-tokenize
        consistently:

        - the forced text must encode to tokens whose bytes are exactly that text;
        - joined to the last accepted token, it must encode to that token plus the same tokens
          (no merge across the left boundary);
        - a last token that a longer token starts with is left to normal decoding (it might
          merge with the free text after it), unless the grammar ends right after it.

        `in_flight`: the step that samples the next token is already launched. Its mask then
        allows only the first forced token, so the caller knows that token's value before
        the device does; only the rest save a forward pass.
        """
        if self.done or limit <= 0 or not self.jump:
            return []
        try:
            text = self.matcher.find_jump_forward_string()
        except UnicodeDecodeError:  # it stops inside a multi-byte character
            return []
        if not text:
            return []
        ids = self.vocab.consistent_tokens(self.accepted[-1] if self.accepted else -1, text)
        if not ids:
            self.stats.jump_forward_refused += 1
            return []
        taken: list[int] = []
        for t in ids[:limit]:
            if not self.matcher.accept_token(t):
                break
            taken.append(t)
        self.accepted += taken
        self._changed()
        while taken and not self.done and self.vocab.extendable[taken[-1]]:
            self.rollback(1)
            taken.pop()
        if in_flight and taken:
            self._forced_next = taken[0]
        self.stats.jump_forward_tokens += len(taken) - (in_flight and bool(taken))
        return taken

    def rollback(self, n: int) -> None:
        """Forget the last n accepted tokens."""
        assert 0 <= n <= len(self.accepted), f"cannot roll back {n} of {len(self.accepted)}"
        if n == 0:
            return
        self._forced_next = None
        self.matcher.rollback(n)
        del self.accepted[-n:]
        self.done = False
        self._changed()

    def rebuild(self, tokens: Sequence[int]) -> None:
        """Reset and replay `tokens` (what the request's output holds)."""
        self.matcher.reset()
        self._forced_next = None
        self.accepted = []
        self.done = False
        self._changed()
        for t in tokens:
            if self.done:
                raise GrammarViolation(f"token {t} after the grammar finished")
            self.accept(t)

    def _changed(self) -> None:
        """Recompute `done` after the state moved; keep the mask computed for it."""
        self._row_valid = False
        if self.matcher.is_terminated():
            self.done = True
            return
        if not self.matcher.is_completed():
            self.done = False
            return
        # Complete: done unless some non-stop token may still follow.
        if self._row is None:
            self._row = xgr.allocate_token_bitmask(1, self.vocab.vocab_size)
        self.matcher.fill_next_token_bitmask(self._row, 0)
        self._row_valid = True
        allowed = self._row[0] & self.vocab.non_stop_bits(self.stop_token_ids)
        self.done = not bool(allowed.any())


class GrammarBackend:
    """Makes the per-request grammars of one executor; holds what they share."""

    def __init__(
        self,
        tok: GrammarTokenizer,
        get_compiled: Callable[[str], xgr.CompiledGrammar],
        jump_forward: bool = True,
    ) -> None:
        self.vocab = GrammarVocab(tok)
        self.get_compiled = get_compiled
        self.jump_forward = jump_forward
        self.stats = GrammarStats()

    def new_request(self, key: str, stop_token_ids: Sequence[int] = ()) -> RequestGrammar:
        """The grammar state of a new request. `stop_token_ids`: the request's EOS ids (the
        tokens that may end it where the grammar accepts); empty: the tokenizer's."""
        return RequestGrammar(
            self.get_compiled(key), self.vocab, self.stats, stop_token_ids, self.jump_forward
        )

    def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
        """A CPU int32 [rows, ceil(vocab / 32)] bitmask, every token allowed."""
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab.vocab_size)
        return bitmask.pin_memory() if pin_memory else bitmask


def _bit(token: int) -> int:
    """Token's bit in its int32 bitmask word (bit 31 as a negative value)."""
    b = 1 << (token & 31)
    return b - (1 << 32) if b >= 1 << 31 else b
