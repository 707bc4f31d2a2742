"""Makes the per-request grammars of one executor and holds what they share: the
vocabulary, the counters, jump-forward and the compiled grammars' source."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr

from services.executor.grammar.jump_forward import JumpForward
from services.executor.grammar.matcher import GrammarStats, RequestGrammar
from services.executor.grammar.vocab import GrammarVocab
from shared.grammar import GrammarTokenizer


class GrammarBackend:
    def __init__(
        self,
        tok: GrammarTokenizer,
        get_compiled: Callable[[str], xgr.CompiledGrammar],
        jump_forward: bool = True,
    ) -> None:
        self.vocab = GrammarVocab(tok)
        self.get_compiled = get_compiled  # the compiled grammar of a key (grammar/cache.py)
        self.stats = GrammarStats()
        self.jumper = JumpForward(self.vocab, self.stats, jump_forward)

    @property
    def jump_forward(self) -> bool:
        return self.jumper.enabled

    @jump_forward.setter
    def jump_forward(self, on: bool) -> None:
        self.jumper.enabled = on

    def new_request(self, key: str, stop_token_ids: Sequence[int] = ()) -> RequestGrammar:
        """The grammar state of a new request. `stop_token_ids`: the request's EOS ids (the
        tokens that may end it where the grammar accepts); empty: the tokenizer's."""
        return RequestGrammar(
            self.get_compiled(key), self.vocab, self.stats, self.jumper, stop_token_ids
        )

    def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
        """A CPU int32 [rows, ceil(vocab / 32)] bitmask, every token allowed."""
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab.vocab_size)
        return bitmask.pin_memory() if pin_memory else bitmask
