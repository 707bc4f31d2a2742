"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and for
SentencePiece (a token's leading space depends on its left neighbour). So each step decodes a
short window: the tokens already emitted since `surr` (context) plus the new ones, and emits the
text beyond the context's own decoding — unless it ends in U+FFFD, an incomplete character,
in which case the tokens wait for the next step.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.ids: list[int] = []
        self.surr = 0  # start of the context window
        self.read = 0  # tokens before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, **self.kwargs))

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        context = self._decode(self.ids[self.surr : self.read])
        full = self._decode(self.ids[self.surr :])
        if full.endswith("\ufffd") or len(full) < len(context):
            return ""  # an incomplete character: wait for more tokens
        # Advance even when the tokens decoded to nothing (skipped special tokens): a window
        # that only grows would make every later step decode all of it again.
        self.surr, self.read = self.read, len(self.ids)
        return full[len(context) :]

    def flush(self) -> str:
        """At the end: whatever is left, replacement characters included."""
        if self.read == len(self.ids):
            return ""
        context = self._decode(self.ids[self.surr : self.read])
        full = self._decode(self.ids[self.surr :])
        self.surr = self.read = len(self.ids)
        return full[len(context) :]
