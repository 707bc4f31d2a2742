"""Executor service: the one reader of rs:exec:{id}; steps the engine; publishes token batches.

Three tasks: the reader hands messages to the engine's inbox, the stepper runs `engine.step`
in a worker thread back to back while there is work, and the sender publishes each step's
output in order. No step waits on Redis: publishing step N overlaps computing step N+1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from services.executor.builder import build_engine, settings_from_flags
from services.executor.distributed.node import ExecutorGroup, exit_rank, run_follower_node
from services.executor.engine.loop import AbortEverything, Engine
from services.executor.engine.outputs import stamp_published
from services.executor.flags import add_flags
from services.executor.grammar.backend import GrammarBackend
from services.executor.grammar.cache import GrammarCache
from services.executor.load_progress import ProgressReporter
from services.executor.metrics import executor_metrics
from services.executor.rates import Window
from services.executor.sender import Outputs, send_in_order
from services.executor.tracing import record_request
from shared import constants
from shared.bus import StreamReader, publish_many
from shared.config import EnvArgumentParser, add_common_flags
from shared.grammar import GrammarTokenizer
from shared.grammar_store import GrammarStore
from shared.logs import setup_logging
from shared.messages.detok import RequestFailed
from shared.messages.heartbeat import ExecutorLoad
from shared.messages.schedule import ExecutorMessage, TokenizedRequest
from shared.model_files import resolve_model
from shared.service import Service, default_instance_id, run_async, service_from_flags

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve executor", description=__doc__)
    add_common_flags(p)
    add_flags(p)
    return p.parse_args(argv)


async def run_engine(
    svc: Service,
    engine: Engine,
    reader: StreamReader[ExecutorMessage],
    grammar_cache: GrammarCache,
) -> None:
    loop = asyncio.get_running_loop()
    steps = executor_metrics(svc.metrics, engine)
    svc.watch("executor", reader)
    engine.trace_requests = svc.tracing.on
    wake = asyncio.Event()
    outbox: asyncio.Queue[Outputs] = asyncio.Queue()
    stepper_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")

    async def read() -> None:
        while not svc.stopping.is_set():
            entries = await reader.read(count=256, block_ms=200)
            # Compiled grammars are fetched here, so the stepping thread never waits on Redis;
            # messages are then submitted in order, so an abort never overtakes its request.
            errors = await asyncio.gather(
                *(
                    grammar_cache.prefetch(e.message.grammar_key, e.message.constraint)
                    for e in entries
                    if isinstance(e.message, TokenizedRequest) and e.message.grammar_key
                )
            )
            failed = iter(errors)
            for e in entries:
                msg = e.message
                if isinstance(msg, TokenizedRequest) and msg.grammar_key:
                    error = next(failed)
                    if error is not None:
                        outbox.put_nowait(
                            [(msg.detok_stream, RequestFailed(rid=msg.trace.rid, error=error))]
                        )
                        continue
                engine.submit(msg)
            wake.set()

    async def step() -> None:
        # After a stop signal, keep stepping what is already admitted until it finishes or
        # the service's drain timeout cancels this task.
        while not svc.stopping.is_set() or engine.policy.has_work():
            if not engine.has_work():
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.2):  # keeps a cancel, unlike 3.11's wait_for
                        await wake.wait()
                continue
            started = time.perf_counter()
            result = await loop.run_in_executor(stepper_pool, engine.step)
            steps.observe(time.perf_counter() - started, result.phase)
            if result.outputs:
                outbox.put_nowait(result.outputs)
            for finished in result.traced:
                record_request(svc.tracing, finished)
        await outbox.join()

    async def publish(outputs: Outputs) -> None:
        await publish_many(svc.r, stamp_published(outputs, time.time()))

    # The sender is watched like the other two: should it fail (not a Redis outage: it
    # retries those), the executor stops rather than stepping with nobody publishing.
    async def read_and_step() -> None:
        await asyncio.gather(read(), step())

    sender = asyncio.create_task(send_in_order(outbox, publish), name="sender")
    work = asyncio.create_task(read_and_step(), name="read-and-step")
    try:
        await asyncio.wait([sender, work], return_when=asyncio.FIRST_COMPLETED)
        if sender.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            sender.result()  # its error, if it has one
            raise RuntimeError("the executor's sender stopped")
        work.result()
    finally:
        work.cancel()
        sender.cancel()
        stepper_pool.shutdown(wait=False)


def executor_load(engine: Engine, grammar_cache: GrammarCache, rates: Window) -> ExecutorLoad:
    """The heartbeat's load: the engine's, with the compiled-grammar cache's counters and the
    generation rate over the recent heartbeats (`rates`, this function's own samples)."""
    stats = grammar_cache.stats
    totals = engine.stats
    rates.add(time.monotonic(), totals.generated_tokens, totals.prompt_tokens, totals.cached_tokens)
    return msgspec.structs.replace(
        engine.load(),
        grammar_cache_hits=stats.hits,
        grammar_fetched=stats.fetched,
        grammar_load_s=stats.load_s,
        gen_throughput=rates.throughput,
    )


async def serve(a: argparse.Namespace, argv: list[str]) -> None:
    group = ExecutorGroup.start(a, argv)
    try:
        await serve_leader(a, group)
    finally:
        group.close()


async def serve_leader(a: argparse.Namespace, group: ExecutorGroup) -> None:
    source = resolve_model(a.model, a.served_model_name)
    instance = a.instance_id or default_instance_id()
    stream = constants.executor_stream(instance)
    progress = ProgressReporter(a.redis_url, instance)
    progress("tokenizer", 0.0)
    grammar_tok = GrammarTokenizer.load(source)

    # The service (and its Redis client) first: the engine's grammars load through it. It
    # beats only once `run` starts, with the engine loaded by then.
    rates = Window()

    def load() -> ExecutorLoad:
        return executor_load(engine, grammar_cache, rates)

    svc = service_from_flags("executor", a, source.name, instance, load=load, drain_timeout_s=30.0)
    grammar_cache = GrammarCache(GrammarStore(svc.r, a.grammar_cache_ttl), grammar_tok)
    grammars = GrammarBackend(
        grammar_tok, grammar_cache.get, jump_forward=not a.disable_jump_forward
    )
    engine = build_engine(
        settings_from_flags(a, source, instance, stream, len(grammar_tok.tokenizer)),
        progress,
        grammars=grammars,
        tp=group.tp,
        device=group.device,
    )
    group.runner = engine.runner
    progress.finish()
    reader: StreamReader[ExecutorMessage] = StreamReader(
        svc.r, stream, ExecutorMessage, trim_consumed=True
    )
    # Queued before the first entry of the restarted server is read, so it ends only the
    # requests from before the restart.
    reader.on_restart.append(lambda: engine.submit(AbortEverything("redis restarted")))
    await reader.start_from_now()  # before the first heartbeat makes the scheduler route here
    log.info(
        "executor ready: %s on %s, %d KV slots",
        source.name,
        engine.runner.device,
        engine.policy.kv.num_slots,
    )
    await svc.run(run_engine(svc, engine, reader, grammar_cache))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    setup_logging("executor", a.instance_id or default_instance_id(), a.log_level)
    if a.node_rank > 0:  # another host's ranks of the group: no bus, only the model
        exit_rank(run_follower_node(a, argv))
    run_async(lambda: serve(a, argv))


if __name__ == "__main__":
    main()
