"""Jump-forward: text the grammar forces is appended without sampling it token by token.

The forced tokens are accepted into the request's matcher at once and computed by the engine
in one extend step (or beside the next decode token), instead of one forward pass each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.executor.grammar.vocab import GrammarVocab

if TYPE_CHECKING:
    from services.executor.grammar.matcher import GrammarStats, RequestGrammar


class JumpForward:
    """The executor's jump-forward (`enabled` False: --disable-jump-forward)."""

    def __init__(self, vocab: GrammarVocab, stats: GrammarStats, enabled: bool = True) -> None:
        self.vocab, self.stats, self.enabled = vocab, stats, enabled

    def forced(self, g: RequestGrammar, limit: int, in_flight: bool = False) -> list[int]:
        """Tokens of the text `g` now forces, at most `limit`, accepted into `g`: the caller
        appends them to the output. Empty when nothing is forced, jump-forward is off, or the
        forced text does not re-tokenize consistently:

        - the forced text must encode to tokens whose bytes are exactly that text;
        - joined to the last accepted token, it must encode to that token plus the same tokens
          (no merge across the left boundary);
        - a last token that a longer token starts with is left to normal decoding (it might
          merge with the free text after it), unless the grammar ends right after it.

        `in_flight`: the step that samples the next token is already launched. Its mask then
        allows only the first forced token, so the caller knows that token's value before
        the device does; only the rest save a forward pass.
        """
        if g.done or limit <= 0 or not self.enabled:
            return []
        try:
            text = g.matcher.find_jump_forward_string()
        except UnicodeDecodeError:  # it stops inside a multi-byte character
            return []
        if not text:
            return []
        ids = self.vocab.consistent_tokens(g.accepted[-1] if g.accepted else -1, text)
        if not ids:
            self.stats.jump_forward_refused += 1
            return []
        taken: list[int] = []
        for t in ids[:limit]:
            if not g.matcher.accept_token(t):
                break
            taken.append(t)
        g.accepted += taken
        g.changed()
        while taken and not g.done and self.vocab.extendable[taken[-1]]:
            g.rollback(1)
            taken.pop()
        self.stats.jump_forward_tokens += len(taken) - (in_flight and bool(taken))
        return taken
