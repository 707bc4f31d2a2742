"""What every grammar matcher of one executor shares: the tokenizer, each token's bytes,
which tokens may merge with the text after them, stop-token bit patterns, and the memo of
forced strings' tokens (jump-forward asks for the same strings again and again)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from shared.grammar import GrammarTokenizer

JUMP_CACHE_ENTRIES = 65536  # memoised forced strings per executor, then the memo starts over


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
