"""Grammar service: reads rs:grammar as a consumer-group member, writes to rs:schedule.

For each constrained request it looks the constraint's key up in Redis (a compiled grammar, or
the compiler's earlier refusal), compiles it in a thread on a miss and stores the result, then
forwards the request to the scheduler with the key, or fails it with a 400. Every replica and
every executor share the cache. Entries are handled concurrently (a slow compile never holds
up cache hits behind it) and acked after their messages are published; a request redelivered
after a crash finds its grammar cached, and the scheduler drops duplicates by request id.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis

from services.grammar.book import CompileBook, Recent, Share
from services.grammar.core import GrammarCompiler, GrammarStats, expired, route
from services.grammar.flags import DEFAULT_COMPILE_TIMEOUT_S, add_flags
from services.grammar.metrics import GrammarMetrics
from shared import constants
from shared.bus import Entry, GroupConsumer
from shared.config import EnvArgumentParser, add_common_flags
from shared.grammar import GrammarTokenizer, constraint_kind
from shared.grammar_store import GrammarStore
from shared.logs import setup_logging
from shared.messages.common import Constraint
from shared.messages.grammar import (
    CompiledGrammarEntry,
    GrammarCacheEntry,
    GrammarErrorEntry,
    GrammarMessage,
)
from shared.model_files import resolve_model
from shared.service import default_instance_id, run_async, service_from_flags
from shared.tracing import Tracing

log = logging.getLogger(__name__)

MAX_INFLIGHT = 64  # requests one instance handles at once (most wait on Redis, not a compile)
SUMMARY_INTERVAL_S = 30.0
# How long a compile's timeout refusal holds (its `until`; the entry itself stays in the cache
# for the cache's lifetime): retries within it are refused at once (a grammar that really
# takes that long is not compiled again and again), later ones compile it again.
TIMEOUT_REFUSAL_HOLDS_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve grammar", description=__doc__)
    add_common_flags(p)
    add_flags(p)
    return p.parse_args(argv)


class GrammarWorker:
    """The async shell around a GrammarCompiler: consumer group in, messages out."""

    def __init__(
        self,
        store: GrammarStore,
        consumer: GroupConsumer[GrammarMessage],
        compiler: GrammarCompiler,
        threads: int = 2,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.store, self.consumer, self.compiler = store, consumer, compiler
        self.threads, self.compile_timeout_s = threads, compile_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.book = CompileBook()
        self._compiling: dict[str, asyncio.Future[GrammarCacheEntry]] = {}  # key -> in flight
        self.on_compiled: Callable[[GrammarCacheEntry], None] = lambda _: None  # (metrics)
        self.tracing = Tracing("grammar", "")  # the service's own, when it traces

    @classmethod
    def on(
        cls,
        r: aioredis.Redis,
        compiler: GrammarCompiler,
        consumer_name: str,
        threads: int = 2,
        cache_ttl_s: float = constants.GRAMMAR_CACHE_TTL_S,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> GrammarWorker:
        """A worker reading rs:grammar as `consumer_name`, storing in Redis `r`."""
        consumer: GroupConsumer[GrammarMessage] = GroupConsumer(
            r,
            constants.GRAMMAR_STREAM,
            constants.GRAMMAR_GROUP,
            consumer_name,
            GrammarMessage,
            service="grammar",  # a dead replica's compiles are taken over at once
        )
        return cls(GrammarStore(r, cache_ttl_s), consumer, compiler, threads, compile_timeout_s)

    @property
    def stats(self) -> GrammarStats:
        return self.compiler.stats

    async def run(self, stopping: asyncio.Event) -> None:
        """Handle entries until `stopping` is set, then finish the ones in hand."""
        await self.consumer.ensure_group()
        tasks: set[asyncio.Task[None]] = set()
        last_summary, reported = time.monotonic(), ""
        try:
            while not stopping.is_set():
                if len(tasks) >= MAX_INFLIGHT:
                    done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    _raise_failures(done)
                    continue
                entries = await self.consumer.read(count=MAX_INFLIGHT - len(tasks), block_ms=500)
                for e in entries:
                    tasks.add(asyncio.create_task(self.handle(e), name=f"grammar-{e.id!r}"))
                done = {t for t in tasks if t.done()}
                tasks -= done
                _raise_failures(done)
                if time.monotonic() - last_summary > SUMMARY_INTERVAL_S:
                    last_summary, summary = time.monotonic(), self.stats.summary()
                    if summary != reported:
                        log.info("grammar cache: %s", summary)
                        reported = summary
            if tasks:
                _raise_failures((await asyncio.wait(tasks))[0])
        finally:
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        """Stop the compile threads (after the last `run`: a failed run may be started again)."""
        self.pool.shutdown(wait=False)

    async def handle(self, entry: Entry[GrammarMessage]) -> None:
        req = entry.message
        started = time.time()
        out = expired(req)
        result: GrammarCacheEntry | None = None
        if out is None:
            if req.constraint is None:  # nothing to compile: pass it on as it is
                out = [(constants.SCHEDULE_STREAM, req)]
            else:
                key = self.compiler.key(req.constraint)
                result = await self.entry(key, req.constraint)
                out = route(req, key, result)
        await self.consumer.commit(out, [entry.id], maxlen=constants.WORK_STREAM_MAXLEN)
        if self.tracing.on:
            self.tracing.record(
                "grammar",
                req.trace.traceparent,
                started,
                time.time(),
                {
                    "rid": req.trace.rid,
                    "kind": constraint_kind(req.constraint) if req.constraint else "",
                    "refused": isinstance(result, GrammarErrorEntry),
                },
            )

    async def entry(self, key: str, constraint: Constraint) -> GrammarCacheEntry:
        """The cache entry of `key`, compiling (once per key in this instance) on a miss."""
        self.stats.requests += 1
        cached = await self.store.get(key)
        if isinstance(cached, GrammarErrorEntry) and cached.until and cached.until < time.time():
            cached = None  # a timeout's refusal, lapsed: compile it again
        if cached is not None:
            self.stats.cache_hits += 1
            log.debug("grammar %s (%s): cache hit", key, cached.kind)
            return cached
        decision = self.book.lookup(key)
        if isinstance(decision, Share):  # another request is compiling it: share that compile
            self.stats.cache_hits += 1
            return await asyncio.shield(self._compiling[key])
        if isinstance(decision, Recent):
            await self.store.put(key, decision.entry)
            self.stats.cache_hits += 1
            return decision.entry
        future: asyncio.Future[GrammarCacheEntry] = asyncio.get_running_loop().create_future()
        self._compiling[key] = future
        self.book.started(key)
        try:
            result, timed_out = await self._compile_and_store(key, constraint)
        except BaseException as e:
            self.book.abandoned(key)
            future.set_exception(e)
            future.exception()  # retrieved: waiters re-raise it, nobody else must log it
            raise
        else:
            if timed_out:  # holds TIMEOUT_REFUSAL_HOLDS_S (`until`); the instance forgets it
                self.book.abandoned(key)
            else:
                self.book.finished(key, result)
            future.set_result(result)
            return result
        finally:
            del self._compiling[key]

    async def _compile_and_store(
        self, key: str, constraint: Constraint
    ) -> tuple[GrammarCacheEntry, bool]:
        """(the entry, whether the compile timed out). The timeout counts the compile's own
        time, from when a thread takes it: under load, compiles queue behind each other for
        the pool's threads (60 distinct schemas at once on a 2-core machine waited past 10 s
        while each compiled in 0.4-2 s), and waiting is no fault of the grammar."""
        loop = asyncio.get_running_loop()
        began: asyncio.Future[None] = loop.create_future()

        def compile_now() -> GrammarCacheEntry:
            loop.call_soon_threadsafe(_settle, began)
            return self.compiler.compile(constraint)

        work = loop.run_in_executor(self.pool, compile_now)
        # work too: should its thread never begin it (a failure), that ends the wait
        waiting: list[asyncio.Future[Any]] = [began, work]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        timed_out = False
        try:
            async with asyncio.timeout(self.compile_timeout_s):  # a cancel is kept (3.11)
                result = await asyncio.shield(work)
        except TimeoutError:
            result, timed_out = self._timed_out(constraint), True
        await self.store.put(key, result)
        self.on_compiled(result)
        if isinstance(result, CompiledGrammarEntry):
            log.info(
                "compiled %s grammar %s in %.1f ms (%d KiB cached)",
                result.kind,
                key,
                result.compile_ms,
                len(result.data) // 1024,
            )
        elif isinstance(result, GrammarErrorEntry):
            log.info("refused %s grammar %s: %s", result.kind, key, result.message)
        return result, timed_out

    def _timed_out(self, constraint: Constraint) -> GrammarErrorEntry:
        """A compile past the timeout is refused, for TIMEOUT_REFUSAL_HOLDS_S.

        A native compile cannot be interrupted: its thread runs on to the end. The pool is
        replaced so that the compiles after it get threads of their own, not a place behind it.
        """
        self.pool.shutdown(wait=False)
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="grammar")
        self.stats.compile_errors += 1
        kind = constraint_kind(constraint)
        # A timed-out compile may have been starved of CPU rather than slow: its refusal
        # holds a minute, not the cache's lifetime, and the grammar is tried again after.
        return GrammarErrorEntry(
            message=f"the {kind} grammar took longer than {self.compile_timeout_s:g} s to compile",
            kind=kind,
            until=time.time() + TIMEOUT_REFUSAL_HOLDS_S,
        )


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _raise_failures(done: set[asyncio.Task[None]]) -> None:
    """A handler that failed (Redis gone for good, a bug) stops the service loudly."""
    for t in done:
        error = None if t.cancelled() else t.exception()
        if error is not None:
            raise error


async def serve(a: argparse.Namespace) -> None:
    source = resolve_model(a.model, a.served_model_name)
    started = time.perf_counter()
    tok = GrammarTokenizer.load(source)
    compiler = GrammarCompiler(tok, threads=a.grammar_threads)
    svc = service_from_flags("grammar", a, source.name)
    worker = GrammarWorker.on(
        svc.r,
        compiler,
        svc.instance,
        threads=a.grammar_threads,
        cache_ttl_s=a.grammar_cache_ttl,
        compile_timeout_s=a.grammar_compile_timeout,
    )
    worker.on_compiled = GrammarMetrics(svc.metrics, compiler.stats).compiled
    worker.tracing = svc.tracing
    svc.watch("grammar", worker.consumer)
    log.info(
        "grammar ready: model %s, vocab %d, tokenizer %s (%.1f s)",
        source.name,
        tok.info.vocab_size,
        tok.fingerprint[:12],
        time.perf_counter() - started,
    )

    async def work() -> None:
        await worker.run(svc.stopping)

    try:
        await svc.run(work)
    finally:
        worker.close()
    log.info("grammar cache: %s", compiler.stats.summary())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("grammar", args.instance_id or default_instance_id(), args.log_level)
    run_async(lambda: serve(args))


if __name__ == "__main__":
    main()
