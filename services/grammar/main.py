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
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import msgspec
import redis.asyncio as aioredis

from services.grammar.core import GrammarCompiler, GrammarStats, expired, route
from shared import constants
from shared.bus import Entry, GroupConsumer
from shared.config import EnvArgumentParser, add_common_flags, positive
from shared.grammar import GrammarTokenizer, constraint_kind
from shared.logs import setup_logging
from shared.messages.common import Constraint
from shared.messages.grammar import (
    CompiledGrammarEntry,
    GrammarCacheEntry,
    GrammarErrorEntry,
    GrammarMessage,
)
from shared.model_files import resolve_model
from shared.service import Service, default_instance_id, run_async

log = logging.getLogger(__name__)

MAX_INFLIGHT = 64  # requests one instance handles at once (most wait on Redis, not a compile)
SUMMARY_INTERVAL_S = 30.0
DEFAULT_COMPILE_TIMEOUT_S = 10.0
RECENT_ENTRIES = 256  # compiled grammars an instance remembers itself (see GrammarWorker)


def add_flags(p: EnvArgumentParser) -> None:
    """The grammar service's own flags (`radixserve serve` takes them too)."""
    p.add_flag(
        "--grammar-threads", type=int, default=2, check=positive, help="grammar compile threads"
    )
    p.add_flag(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        check=positive,
        help="seconds a grammar may take to compile; a slower one is refused with a 400",
    )
    p.add_flag(
        "--grammar-cache-ttl",
        type=float,
        default=3600.0,
        check=positive,
        help="seconds a compiled grammar stays in Redis after its last use",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve grammar", description=__doc__)
    add_common_flags(p)
    add_flags(p)
    return p.parse_args(argv)


class GrammarWorker:
    """The async shell around a GrammarCompiler: consumer group in, messages out."""

    def __init__(
        self,
        r: aioredis.Redis,
        compiler: GrammarCompiler,
        consumer_name: str,
        threads: int = 2,
        cache_ttl_s: float = 3600.0,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.r, self.compiler = r, compiler
        self.cache_ttl_ms = int(cache_ttl_s * 1000)
        self.threads, self.compile_timeout_s = threads, compile_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.consumer: GroupConsumer[GrammarMessage] = GroupConsumer(
            r, constants.GRAMMAR_STREAM, constants.GRAMMAR_GROUP, consumer_name, GrammarMessage
        )
        self._compiling: dict[str, asyncio.Future[GrammarCacheEntry]] = {}  # key -> in flight
        # key -> entry this instance compiled lately. A request whose cache read went out
        # before a concurrent compile of its key stored the entry, and came back after that
        # compile finished, finds it here instead of compiling it a second time.
        self._recent: OrderedDict[str, GrammarCacheEntry] = OrderedDict()
        self._decoder = msgspec.msgpack.Decoder(GrammarCacheEntry)
        self._encoder = msgspec.msgpack.Encoder()

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
        out = expired(req)
        if out is None:
            if req.constraint is None:  # nothing to compile: pass it on as it is
                out = [(constants.SCHEDULE_STREAM, req)]
            else:
                key = self.compiler.key(req.constraint)
                out = route(req, key, await self.entry(key, req.constraint))
        await self.consumer.commit(out, [entry.id], maxlen=constants.WORK_STREAM_MAXLEN)

    async def entry(self, key: str, constraint: Constraint) -> GrammarCacheEntry:
        """The cache entry of `key`, compiling (once per key in this instance) on a miss."""
        self.stats.requests += 1
        raw = await self.r.getex(constants.grammar_cache_key(key), px=self.cache_ttl_ms)
        if raw is not None:
            try:
                cached = self._decoder.decode(raw)
            except msgspec.DecodeError as e:
                log.warning("recompiling grammar %s: its cache entry is unreadable (%s)", key, e)
            else:
                self.stats.cache_hits += 1
                log.debug("grammar %s (%s): cache hit", key, cached.kind)
                return cached
        pending = self._compiling.get(key)
        if pending is not None:  # another request is compiling it: share that compile
            self.stats.cache_hits += 1
            return await asyncio.shield(pending)
        recent = self._recent.get(key)
        if recent is not None:
            # Stored again: Redis missed it, maybe because it expired, and executors load
            # grammars from Redis.
            await self._store(key, recent)
            self.stats.cache_hits += 1
            return recent
        future: asyncio.Future[GrammarCacheEntry] = asyncio.get_running_loop().create_future()
        self._compiling[key] = future
        try:
            result = await self._compile_and_store(key, constraint)
            future.set_result(result)
            self._recent[key] = result
            while len(self._recent) > RECENT_ENTRIES:
                self._recent.popitem(last=False)
            return result
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: waiters re-raise it, nobody else must log it
            raise
        finally:
            del self._compiling[key]

    async def _store(self, key: str, entry: GrammarCacheEntry) -> None:
        await self.r.set(
            constants.grammar_cache_key(key), self._encoder.encode(entry), px=self.cache_ttl_ms
        )

    async def _compile_and_store(self, key: str, constraint: Constraint) -> GrammarCacheEntry:
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.pool, self.compiler.compile, constraint)
        try:
            result = await asyncio.wait_for(asyncio.shield(work), self.compile_timeout_s)
        except TimeoutError:
            result = self._timed_out(constraint)
        await self._store(key, result)
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
        return result

    def _timed_out(self, constraint: Constraint) -> GrammarErrorEntry:
        """A compile past the timeout is refused, and the refusal cached like any other.

        A native compile cannot be interrupted: its thread runs on to the end. The pool is
        replaced so that the compiles after it get threads of their own, not a place behind it.
        """
        self.pool.shutdown(wait=False)
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="grammar")
        self.stats.compile_errors += 1
        kind = constraint_kind(constraint)
        return GrammarErrorEntry(
            message=f"the {kind} grammar took longer than {self.compile_timeout_s:g} s to compile",
            kind=kind,
        )


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
    svc = Service(
        "grammar",
        a.instance_id or default_instance_id(),
        a.redis_url,
        max_connections=a.redis_max_connections,
    )
    worker = GrammarWorker(
        svc.r,
        compiler,
        svc.instance,
        threads=a.grammar_threads,
        cache_ttl_s=a.grammar_cache_ttl,
        compile_timeout_s=a.grammar_compile_timeout,
    )
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
