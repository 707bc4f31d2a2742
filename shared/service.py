"""The skeleton every service runs in.

- a liveness key refreshed every HEARTBEAT_INTERVAL_S with a TTL (plus load, for executors,
  and the model's description, for tokenizers);
- every task it starts is supervised: a worker given as a function that fails with a transient
  Redis error (an outage outlasting the client's retries) is logged and started again with
  backoff; any other failure stops the service loudly (exit non-zero, for its supervisor);
- SIGTERM / SIGINT set `stopping`: workers finish what they hold, then the rest is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from shared import constants
from shared.bus import (
    DEFAULT_MAX_CONNECTIONS,
    TRANSIENT,
    Backoff,
    GroupConsumer,
    StreamReader,
    close,
    connect,
)
from shared.launcher import launcher_gone
from shared.messages.heartbeat import ExecutorLoad, Heartbeat, ModelInfo
from shared.metrics.bus import BusMetrics
from shared.metrics.registry import ServiceMetrics
from shared.metrics.server import start_metrics_server
from shared.tracing import Tracing

log = logging.getLogger(__name__)

# A worker: a coroutine function (restartable) or a coroutine (runs once).
Worker = Callable[[], Coroutine[Any, Any, None]] | Coroutine[Any, Any, None]
# A worker that ran this long before failing restarts without waiting.
RESTART_RESET_S = 30.0


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Service:
    def __init__(
        self,
        name: str,
        instance: str,
        redis_url: str,
        load: Callable[[], ExecutorLoad | None] | None = None,
        drain_timeout_s: float = 10.0,
        model: ModelInfo | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        metrics: ServiceMetrics | None = None,
        metrics_addr: tuple[str, int] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.name, self.instance = name, instance or default_instance_id()
        self.r: aioredis.Redis = connect(redis_url, max_connections)
        self.stopping = asyncio.Event()
        self.started = time.time()
        # Observability: metrics (disabled ones cost nothing), their endpoint (host, port),
        # what every service measures of the bus, and spans (off unless an endpoint is given).
        self.metrics = metrics or ServiceMetrics(name, "", self.instance, enabled=False)
        self.metrics_addr = metrics_addr
        self.bus_metrics = BusMetrics(self.metrics, self.r)
        self.tracing = tracing or Tracing(name, self.instance)
        self.last_beat = 0.0  # monotonic time of the last heartbeat Redis took
        self.metrics_port = 0  # the bound port of the metrics endpoint, once it serves
        self._load = load
        self._model = model  # sent with every heartbeat (tokenizers)
        self.drain_timeout_s = drain_timeout_s
        self._encoder = msgspec.msgpack.Encoder()

    async def wait_for_redis(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.r.ping()
                return
            except TRANSIENT as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name}: Redis unreachable for {timeout_s}s: {e}"
                    ) from e
                await asyncio.sleep(0.2)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            service=self.name,
            instance=self.instance,
            pid=os.getpid(),
            started=self.started,
            ts=time.time(),
            executor=self._load() if self._load else None,
            model=self._model,
            metrics_port=self.metrics_port,
        )

    async def beat_once(self) -> None:
        key = constants.live_key(self.name, self.instance)
        ttl_ms = int(constants.LIVE_TTL_S * 1000)
        await self.r.set(key, self._encoder.encode(self.heartbeat()), px=ttl_ms)
        self.last_beat = time.monotonic()

    def watch(self, label: str, reader: GroupConsumer[Any] | StreamReader[Any]) -> None:
        """Measure a stream this service reads: its entries' wait, its length and backlog."""
        group = reader.group if isinstance(reader, GroupConsumer) else None
        self.bus_metrics.watch(label, reader.stream, group)
        if self.metrics.enabled:
            reader.on_entries.append(self.bus_metrics.observer(label))

    def health_problem(self) -> str | None:
        """None while the service runs and Redis took a heartbeat within the liveness TTL."""
        if self.stopping.is_set():
            return "stopping"
        if not self.last_beat:
            return "no heartbeat yet"
        age = time.monotonic() - self.last_beat
        if age > constants.LIVE_TTL_S:
            return f"last heartbeat reached redis {age:.0f}s ago"
        return None

    async def _beat_forever(self) -> None:
        while not self.stopping.is_set():
            try:
                await self.beat_once()
            except TRANSIENT as e:
                log.warning("heartbeat failed: %s", e)
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout keeps a cancel that 3.11's wait_for can drop
                async with asyncio.timeout(constants.HEARTBEAT_INTERVAL_S):
                    await self.stopping.wait()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)

    def stop(self) -> None:
        if self.stopping.is_set():
            return
        if launcher_gone():
            # The launcher died (its death signal is what stops this process) and took the
            # gateway, its clients and its private Redis with it: nothing in flight can reach
            # anyone, and a drain would wait on a Redis that is not coming back (after a
            # SIGKILLed serve an executor lingered 39 s, its memory in the next start's way).
            # With a shared Redis the failover resumes its requests elsewhere at once: the
            # liveness key goes as the process ends.
            log.info("stopping: the launcher is gone; not draining")
            self.drain_timeout_s = 0.0
        else:
            log.info("stopping: draining for up to %.0fs", self.drain_timeout_s)
        self.stopping.set()

    async def supervise(self, worker: Worker) -> None:
        """Run `worker` to its end. A restartable one that fails with a transient Redis error
        starts again after a backoff (its state lives outside the coroutine); any other
        failure, or any failure of a one-shot coroutine, propagates."""
        backoff = Backoff(base=0.1, cap=5.0)
        name = getattr(worker, "__name__", "worker")
        while True:
            started = time.monotonic()
            try:
                await (worker() if callable(worker) else worker)
                return
            except TRANSIENT as e:
                if not callable(worker) or self.stopping.is_set():
                    raise
                log.warning("%s: redis unavailable (%r); restarting it", name, e)
            if time.monotonic() - started > RESTART_RESET_S:
                backoff.reset()
            await backoff.wait()

    async def run(self, *workers: Worker) -> None:
        """Run `workers` until they all return, one fails, or a stop signal drains them."""
        self._install_signals()
        if _owns_process:
            # What the service loaded to get here (libraries, tokenizer, model, radix tree)
            # lives as long as the process: the collector then never walks it again, neither
            # in a full collection while serving (one pass over the executor's radix tree
            # stalls a step) nor at exit, where it took about 1 s of each service's stop.
            gc.collect()
            gc.freeze()
        endpoint: web.AppRunner | None = None
        if self.metrics_addr is not None:
            host, port = self.metrics_addr
            endpoint = await start_metrics_server(self.metrics, self.health_problem, host, port)
            self.metrics_port = port
        try:
            await self._run(workers)
        finally:
            if endpoint is not None:
                await endpoint.cleanup()
            self.tracing.shutdown()

    async def _run(self, workers: tuple[Worker, ...]) -> None:
        await self.wait_for_redis()
        await self.beat_once()
        tasks = [
            asyncio.create_task(self.supervise(w), name=getattr(w, "__name__", "worker"))
            for w in workers
        ]
        tasks.append(asyncio.create_task(self._beat_forever(), name="heartbeat"))
        stop_wait = asyncio.create_task(self.stopping.wait())
        failure: BaseException | None = None
        try:
            pending: set[asyncio.Task[Any]] = set(tasks)
            while pending and not self.stopping.is_set():
                done, pending = await asyncio.wait(
                    pending | {stop_wait}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stop_wait)
                for t in done:
                    if t is not stop_wait and not t.cancelled() and t.exception() is not None:
                        failure = t.exception()
                        log.error("task %s failed", t.get_name(), exc_info=failure)
                        self.stopping.set()
                if all(t.done() for t in tasks[:-1]):
                    break
            self.stopping.set()
            _, still = await asyncio.wait(tasks, timeout=self.drain_timeout_s)
            for t in still:
                t.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        finally:
            stop_wait.cancel()
            with contextlib.suppress(*TRANSIENT):
                await self.r.delete(constants.live_key(self.name, self.instance))
            await close(self.r)
        if failure is not None:
            raise SystemExit(f"{self.name} stopped after a failure: {failure!r}")


def service_from_flags(
    name: str, a: Any, model_name: str = "", instance: str = "", **kw: Any
) -> Service:
    """A Service with the observability its flags ask for (shared/config.py's
    add_observability_flags): metrics labelled with `model_name`, their endpoint, spans."""
    instance = instance or a.instance_id or default_instance_id()
    metrics = ServiceMetrics(name, model_name, instance, enabled=a.enable_metrics)
    # The port serves /health for probes even with metrics off.
    port = a.metrics_port
    return Service(
        name,
        instance,
        a.redis_url,
        max_connections=a.redis_max_connections,
        metrics=metrics,
        metrics_addr=(a.metrics_host, port) if port > 0 else None,
        tracing=Tracing.from_flags(a, name, instance),
        **kw,
    )


def model_label(a: Any) -> str:
    """The served model's name for a service that does not load it (metrics' model_name)."""
    from shared.model_files import ModelNotFoundError, resolve_model

    try:
        return resolve_model(a.model, a.served_model_name).name
    except ModelNotFoundError:
        return a.served_model_name or a.model


# Set by run_async, which only a service's own process calls (its `main`): a Service run
# inside another program (a test, an embedding) leaves that program's collector alone.
_owns_process = False


def run_async(main: Callable[[], Awaitable[None]]) -> None:
    """asyncio.run on uvloop where available; the process is the service's own."""
    global _owns_process
    _owns_process = True
    try:
        import uvloop

        uvloop.run(main())  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(main())  # type: ignore[arg-type]


async def live_instances(r: aioredis.Redis, service: str) -> list[Heartbeat]:
    """Heartbeats of every live instance of `service` (expired keys are gone by TTL)."""
    decoder = msgspec.msgpack.Decoder(Heartbeat)
    keys = [k async for k in r.scan_iter(match=f"{constants.LIVE_PREFIX}:{service}:*", count=500)]
    if not keys:
        return []
    values = await r.mget(keys)
    return [decoder.decode(v) for v in values if v is not None]
