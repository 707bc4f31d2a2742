"""The metrics layer every service shares: labels, totals read at scrape time, the no-op when
disabled, the bus's measures against a real Redis, and the /metrics and /health endpoint."""

from __future__ import annotations

import time

import aiohttp
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from services.executor.rates import MIN_SPAN_S, Window
from shared.bus import GroupConsumer
from shared.messages.common import AbortRequest
from shared.metrics.bus import BusMetrics
from shared.metrics.registry import NOOP, ServiceMetrics
from shared.metrics.server import start_metrics_server
from tests.conftest import free_port


def samples(m: ServiceMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(m.text().decode())
        for s in family.samples
    }


COMMON = (("instance_id", "i-1"), ("model_name", "m"))


def test_every_metric_carries_the_model_and_the_instance() -> None:
    m = ServiceMetrics("tokenizer", "m", "i-1")
    m.counter("radixserve:things_total", "things").inc(3)
    m.counter("radixserve:kinds_total", "kinds", ["kind"]).labels("a").inc()
    m.histogram("radixserve:seconds", "time", [0.1, 1.0]).observe(0.5)
    got = samples(m)
    assert got[("radixserve:things_total", COMMON)] == 3
    assert got[("radixserve:kinds_total", tuple(sorted((*COMMON, ("kind", "a")))))] == 1
    assert got[("radixserve:seconds_bucket", tuple(sorted((*COMMON, ("le", "1.0")))))] == 1
    assert not any(name.endswith("_created") for name, _ in got)  # no timestamp series


def test_totals_kept_elsewhere_are_read_when_scraped() -> None:
    m = ServiceMetrics("scheduler", "m", "i-1")
    totals = {"a": 1}
    m.counter_function(
        "radixserve:routed_total", "routed", lambda: {(k,): v for k, v in totals.items()}, ["to"]
    )
    m.gauge_function("radixserve:live", "live", lambda: len(totals))
    totals["b"] = 5
    got = samples(m)
    assert got[("radixserve:routed_total", tuple(sorted((*COMMON, ("to", "b")))))] == 5
    assert got[("radixserve:live", COMMON)] == 2


def test_disabled_metrics_cost_a_call_and_export_nothing() -> None:
    m = ServiceMetrics("executor", "m", "i-1", enabled=False)
    c = m.counter("radixserve:things_total", "things", ["kind"])
    assert c is NOOP and c.labels("a") is NOOP
    c.labels("a").inc()
    m.gauge_function("radixserve:live", "live", lambda: 1 / 0)  # never read
    assert m.text() == b""


def test_rates_come_from_scrapes_at_least_a_second_apart() -> None:
    w = Window()
    w.add(100.0, generated=0, prompt=0, cached=0)
    w.add(100.0 + MIN_SPAN_S / 2, generated=50, prompt=10, cached=5)
    assert w.throughput == 0.0  # too short a span to say
    w.add(102.0, generated=400, prompt=100, cached=25)
    assert w.throughput == pytest.approx(200.0)
    assert w.hit_rate == pytest.approx(0.25)
    w.add(104.0, generated=400, prompt=100, cached=25)  # nothing finished since: rate stays
    assert w.hit_rate == pytest.approx(0.25)
    assert w.throughput == pytest.approx(100.0)


@pytest.mark.redis
async def test_the_bus_measures_waits_lengths_and_backlog(aredis: aioredis.Redis) -> None:
    m = ServiceMetrics("tokenizer", "m", "i-1")
    bus = BusMetrics(m, aredis)
    consumer: GroupConsumer[AbortRequest] = GroupConsumer(
        aredis, "rs:test:work", "g", "c1", AbortRequest
    )
    await consumer.ensure_group()
    bus.watch("work", consumer.stream, consumer.group)
    consumer.on_entries.append(bus.observer("work"))
    for i in range(5):
        await aredis.xadd("rs:test:work", {"m": consumer.codec.encode(AbortRequest(rid=f"r{i}"))})
    entries = await consumer.read(count=3, block_ms=100)
    assert len(entries) == 3
    await bus.refresh()
    got = samples(m)
    work = tuple(sorted((*COMMON, ("stream", "work"))))
    assert got[("radixserve:bus_wait_seconds_count", work)] == 3
    assert got[("radixserve:stream_length", work)] == 5
    assert got[("radixserve:stream_pending", work)] == 5  # 3 unacked + 2 never delivered
    await consumer.ack([e.id for e in entries])
    await bus.refresh()
    assert samples(m)[("radixserve:stream_pending", work)] == 2


async def test_the_endpoint_serves_metrics_and_health() -> None:
    m = ServiceMetrics("grammar", "m", "i-1")
    m.counter("radixserve:things_total", "things").inc()
    problem: list[str | None] = ["no heartbeat yet"]
    port = free_port()
    runner = await start_metrics_server(m, lambda: problem[0], "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 503
                assert (await r.json())["reason"] == "no heartbeat yet"
            problem[0] = None
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 200
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 200 and r.content_type == "text/plain"
                assert "radixserve:things_total" in await r.text()
    finally:
        await runner.cleanup()


def test_a_service_is_healthy_only_while_its_heartbeats_land() -> None:
    from shared.service import Service

    svc = Service("grammar", "i-1", "redis://127.0.0.1:1/0")
    assert svc.health_problem() == "no heartbeat yet"
    svc.last_beat = time.monotonic()
    assert svc.health_problem() is None
    svc.last_beat = time.monotonic() - 3600
    assert "ago" in (svc.health_problem() or "")


async def test_a_taken_port_is_a_clear_error() -> None:
    m = ServiceMetrics("grammar", "m", "i-1")
    port = free_port()
    first = await start_metrics_server(m, lambda: None, "127.0.0.1", port)
    try:
        with pytest.raises(SystemExit, match=f"grammar: cannot serve metrics on 127.0.0.1:{port}"):
            await start_metrics_server(m, lambda: None, "127.0.0.1", port)
    finally:
        await first.cleanup()


def test_the_heartbeat_carries_the_generation_rate_over_its_own_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's /get_server_info reads internal_states[i].last_gen_throughput: the executor's
    heartbeat load takes it over the heartbeats' samples (not the Prometheus scrapes')."""
    import services.executor.main as executor_main
    from services.executor.engine.stats import EngineStats
    from services.executor.grammar.cache import GrammarCacheStats
    from shared.messages.heartbeat import ExecutorLoad

    class FakeEngine:
        stats = EngineStats()

        def load(self) -> ExecutorLoad:
            return ExecutorLoad(
                stream="s", model="m", context_length=8, waiting=0, running=1,
                free_kv_tokens=1, total_kv_tokens=2,
            )  # fmt: skip

    class FakeCache:
        stats = GrammarCacheStats(hits=3)

    engine, rates, now = FakeEngine(), Window(), [50.0]
    monkeypatch.setattr(executor_main.time, "monotonic", lambda: now[0])
    load = executor_main.executor_load(engine, FakeCache(), rates)  # type: ignore[arg-type]
    assert load.gen_throughput == 0.0 and load.grammar_cache_hits == 3
    engine.stats.generated_tokens, now[0] = 300, 52.0
    load = executor_main.executor_load(engine, FakeCache(), rates)  # type: ignore[arg-type]
    assert load.gen_throughput == pytest.approx(150.0)
