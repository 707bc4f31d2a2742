"""The grammar service's synchronous core: a constraint's key and cache entry, and what to
publish for a request once its entry is known. No I/O; the shell runs `compile` in threads."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import msgspec
from msgspec import Struct

from shared import constants
from shared.grammar import (
    GrammarError,
    GrammarTokenizer,
    compile_constraint,
    constraint_kind,
    dump_compiled,
    grammar_key,
    new_compiler,
)
from shared.messages.common import Constraint, ErrorInfo
from shared.messages.detok import RequestFailed
from shared.messages.grammar import CompiledGrammarEntry, GrammarCacheEntry, GrammarErrorEntry
from shared.messages.reply import Failure
from shared.messages.schedule import TokenizedRequest


@dataclass
class GrammarStats:
    """Counters since start (a heartbeat or a log line reports them)."""

    requests: int = 0
    cache_hits: int = 0  # the entry was in Redis (compiled or refused before)
    compiled: int = 0  # compiles that succeeded
    compile_errors: int = 0  # constraints the compiler refused
    compile_s: float = 0.0  # seconds spent compiling, all threads together

    def summary(self) -> str:
        return (
            f"{self.requests} requests, {self.cache_hits} cache hits, {self.compiled} compiled "
            f"({self.compile_s * 1000:.0f} ms), {self.compile_errors} refused"
        )


class GrammarCompiler:
    """Compiles constraints against one model's tokenizer. Thread-safe."""

    def __init__(self, tok: GrammarTokenizer, threads: int = 1) -> None:
        self.tok = tok
        self.compiler = new_compiler(tok, threads)
        self.stats = GrammarStats()
        self._lock = threading.Lock()  # compile() runs in several threads at once

    def key(self, c: Constraint) -> str:
        return grammar_key(c, self.tok.fingerprint)

    def compile(self, c: Constraint) -> GrammarCacheEntry:
        """The cache entry for `c`: compiled, or the compiler's reason for refusing it."""
        kind = constraint_kind(c)
        start = time.perf_counter()
        try:
            compiled = compile_constraint(self.compiler, c)
        except GrammarError as e:
            with self._lock:
                self.stats.compile_errors += 1
                self.stats.compile_s += time.perf_counter() - start
            return GrammarErrorEntry(message=str(e), kind=kind)
        data = dump_compiled(compiled)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_s += elapsed
        return CompiledGrammarEntry(data=data, compile_ms=elapsed * 1000, kind=kind)


def route(req: TokenizedRequest, key: str, entry: GrammarCacheEntry) -> list[tuple[str, Struct]]:
    """Forward the request to the scheduler with its grammar key, or fail it with a 400."""
    if isinstance(entry, GrammarErrorEntry):
        param = req.constraint.param if req.constraint is not None else None
        return fail(req, ErrorInfo(status=400, message=entry.message, param=param))
    return [(constants.SCHEDULE_STREAM, msgspec.structs.replace(req, grammar_key=key))]


def fail(req: TokenizedRequest, error: ErrorInfo) -> list[tuple[str, Struct]]:
    """The gateway hears at once; the detokenizer partition drops the request's state (it
    would forward a Failure too, which the gateway ignores once the request has ended)."""
    rid = req.trace.rid
    return [
        (req.trace.reply_to, Failure(rid=rid, error=error)),
        (req.detok_stream, RequestFailed(rid=rid, error=error)),
    ]


def expired(req: TokenizedRequest, now: float | None = None) -> list[tuple[str, Struct]] | None:
    """The failure to publish when the request's deadline has passed, else None."""
    if req.trace.deadline >= (time.time() if now is None else now):
        return None
    return fail(req, ErrorInfo(status=504, message="the request's deadline passed", type="timeout"))
