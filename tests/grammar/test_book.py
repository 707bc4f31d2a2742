"""The grammar service's cache policy, without Redis: shared compiles, the recent entries."""

from __future__ import annotations

from services.grammar.book import Compile, CompileBook, Recent, Share
from shared.messages.grammar import CompiledGrammarEntry, GrammarErrorEntry

ENTRY = CompiledGrammarEntry(data=b"x", compile_ms=1.0, kind="regex")
REFUSAL = GrammarErrorEntry(message="bad", kind="regex")


def test_a_key_compiling_is_shared_then_remembered() -> None:
    book = CompileBook()
    assert book.lookup("k") == Compile()
    book.started("k")
    assert book.lookup("k") == Share()  # a second request waits for the same compile
    book.finished("k", ENTRY)
    assert book.lookup("k") == Recent(ENTRY)  # the store missed it: this instance has it


def test_refusals_are_remembered_like_grammars_and_failures_are_not() -> None:
    book = CompileBook()
    book.started("bad")
    book.finished("bad", REFUSAL)
    assert book.lookup("bad") == Recent(REFUSAL)
    book.started("err")
    book.abandoned("err")  # the compile raised: nothing to remember, try again
    assert book.lookup("err") == Compile()


def test_the_recent_entries_are_the_last_used_ones() -> None:
    book = CompileBook(recent=2)
    for key in ("a", "b"):
        book.started(key)
        book.finished(key, ENTRY)
    assert book.lookup("a") == Recent(ENTRY)  # used: now the newest
    book.started("c")
    book.finished("c", ENTRY)
    assert book.lookup("b") == Compile()  # the least recently used went
    assert book.lookup("a") == Recent(ENTRY) and book.lookup("c") == Recent(ENTRY)
