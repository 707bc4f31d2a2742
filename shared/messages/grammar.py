"""rs:grammar (tokenizer -> grammar service) and the compiled-grammar cache entries in Redis.

The stream carries the tokenizer's TokenizedRequest unchanged (with its constraint and an empty
`grammar_key`); the grammar service forwards it to rs:schedule with the key filled in, or fails
it. Cache values live at `constants.grammar_cache_key(key)`.
"""

from __future__ import annotations

import msgspec

from shared.messages.schedule import TokenizedRequest

GrammarMessage = TokenizedRequest


class CompiledGrammarEntry(msgspec.Struct, tag="compiled", kw_only=True, frozen=True):
    """A compiled grammar: zlib of xgrammar's `CompiledGrammar.serialize_json()`."""

    data: bytes
    compile_ms: float
    kind: str  # the constraint's tag, for logs


class GrammarErrorEntry(msgspec.Struct, tag="error", kw_only=True, frozen=True):
    """A constraint the compiler refused; cached too, so a bad schema is not compiled again."""

    message: str
    kind: str
    # Unix time after which the refusal no longer holds and the grammar is compiled again
    # (a compile's timeout, which CPU starvation can cause); 0: it holds for good.
    until: float = 0.0


GrammarCacheEntry = CompiledGrammarEntry | GrammarErrorEntry
