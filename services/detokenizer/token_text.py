"""Each token's own text and bytes, as logprobs show them.

A byte-level BPE token may hold part of a UTF-8 character, so its text alone is lossy; its
bytes come from xgrammar's decoded vocabulary (which undoes the byte-level and byte-fallback
encodings). The text is those bytes decoded with U+FFFD for an incomplete character.
"""

from __future__ import annotations

from typing import Any


class TokenTexts:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._vocab: list[bytes] | None = None  # built on the first logprob request
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self._vocab is None:
            # Imported here: xgrammar brings torch, a second of the detokenizer's start that
            # only a logprob request needs.
            import xgrammar as xgr

            self._vocab = list(xgr.TokenizerInfo.from_huggingface(self.tokenizer).decoded_vocab)
        raw = self._vocab[token_id] if token_id < len(self._vocab) else b""
        if raw:
            text = raw.decode("utf-8", errors="replace")
        else:  # special and added tokens decode to nothing in xgrammar's table: use their name
            text = str(self.tokenizer.convert_ids_to_tokens(token_id) or "")
            raw = text.encode()
        out = (text, list(raw))
        self._cache[token_id] = out
        return out
