"""Compiled grammars of one executor, by key: fetched from Redis by the async shell before a
request enters the engine, read by the stepping thread without waiting on anything.

    error = await cache.prefetch(msg.grammar_key, msg.constraint)   # event loop, before submit
    compiled = cache.get(msg.grammar_key)                           # stepping thread

The grammar service put the entry in the store (shared/grammar_store.py) just before it
forwarded the request; reading it extends its life there, as the grammar service's reads do.
Should it be gone (expired, Redis restarted) the executor compiles the constraint itself, in a
thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import xgrammar as xgr

from shared.bus import TRANSIENT
from shared.grammar import (
    GrammarError,
    GrammarTokenizer,
    compile_constraint,
    constraint_kind,
    dump_compiled,
    grammar_key,
    load_compiled,
    new_compiler,
)
from shared.grammar_store import GrammarStore
from shared.messages.common import Constraint, ErrorInfo
from shared.messages.grammar import CompiledGrammarEntry, GrammarErrorEntry

log = logging.getLogger(__name__)


@dataclass
class GrammarCacheStats:
    hits: int = 0  # already in this executor's memory
    fetched: int = 0  # loaded from Redis
    compiled: int = 0  # not in Redis: compiled here
    load_s: float = 0.0  # seconds spent fetching, deserializing and compiling


class GrammarCache:
    """An LRU of deserialized grammars. `get` never waits: a key not prefetched is a KeyError.

    A grammar leaves the LRU only after `capacity` newer ones were prefetched; running
    requests keep theirs alive through their matchers.
    """

    def __init__(self, store: GrammarStore, tok: GrammarTokenizer, capacity: int = 256) -> None:
        self.store, self.tok, self.capacity = store, tok, capacity
        self.stats = GrammarCacheStats()
        self._grammars: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # prefetch (event loop) and get (stepping thread)
        self._compiler: xgr.GrammarCompiler | None = None

    def get(self, key: str) -> xgr.CompiledGrammar:
        with self._lock:
            compiled = self._grammars.get(key)
            if compiled is None:
                raise KeyError(f"grammar {key} was not prefetched")
            self._grammars.move_to_end(key)
            return compiled

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._grammars

    async def prefetch(self, key: str, constraint: Constraint | None) -> ErrorInfo | None:
        """Make `get(key)` succeed; the error to fail the request with when it cannot."""
        if key in self:
            self.stats.hits += 1
            return None
        if constraint is not None and grammar_key(constraint, self.tok.fingerprint) != key:
            # The grammar service compiled for another tokenizer: its masks would be wrong.
            return ErrorInfo(
                status=500,
                message="the grammar service and this executor serve different tokenizers "
                "(check that every service runs the same --model)",
                type="server_error",
            )
        start = time.perf_counter()
        try:
            compiled = await self._load(key)
            if compiled is None:
                if constraint is None:
                    return ErrorInfo(
                        status=503,
                        message=f"compiled grammar {key} is missing from the cache; retry",
                        type="server_error",
                    )
                compiled = await self._compile(key, constraint)
        except GrammarError as e:
            param = constraint.param if constraint is not None else None
            return ErrorInfo(status=400, message=str(e), param=param)
        finally:
            self.stats.load_s += time.perf_counter() - start
        with self._lock:
            self._grammars[key] = compiled
            self._grammars.move_to_end(key)
            while len(self._grammars) > self.capacity:
                self._grammars.popitem(last=False)
        return None

    async def _load(self, key: str) -> xgr.CompiledGrammar | None:
        """From the store; None when absent or unreadable. GrammarError for a cached refusal."""
        try:
            entry = await self.store.get(key)
        except TRANSIENT as e:  # Redis away: compile here rather than stop the reader
            log.warning("grammar %s: cache unreachable (%r)", key, e)
            return None
        if entry is None:
            return None
        if isinstance(entry, GrammarErrorEntry):
            raise GrammarError(entry.message)
        try:
            compiled = await asyncio.to_thread(load_compiled, entry.data, self.tok)
        except ValueError as e:
            log.warning("grammar %s: %s; compiling here", key, e)
            return None
        self.stats.fetched += 1
        return compiled

    async def _compile(self, key: str, constraint: Constraint) -> xgr.CompiledGrammar:
        if self._compiler is None:
            self._compiler = new_compiler(self.tok)
        start = time.perf_counter()
        compiled = await asyncio.to_thread(compile_constraint, self._compiler, constraint)
        elapsed_ms = (time.perf_counter() - start) * 1000
        self.stats.compiled += 1
        log.info("grammar %s was not cached: compiled here in %.1f ms", key, elapsed_ms)
        entry = CompiledGrammarEntry(
            data=dump_compiled(compiled), compile_ms=elapsed_ms, kind=constraint_kind(constraint)
        )
        try:
            await self.store.put(key, entry)
        except TRANSIENT as e:  # only a cache: the request goes on with its grammar
            log.warning("grammar %s: not stored (%r)", key, e)
        return compiled
