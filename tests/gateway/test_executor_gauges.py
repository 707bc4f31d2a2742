"""Executors' gauges on the gateway's /metrics, from their heartbeats: reported for an
executor without a metrics endpoint of its own, under its own labels, left out for one that
has an endpoint, and gone once its heartbeat is."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.app import bound_port, build_app, start_site
from services.gateway.state import GatewaySettings
from shared import constants
from shared.messages.heartbeat import ExecutorLoad
from shared.metrics.registry import ServiceMetrics
from shared.service import Service
from tests.gateway.helpers import MODEL

pytestmark = pytest.mark.redis


def load(running: int, free: int, evictable: int) -> ExecutorLoad:
    return ExecutorLoad(
        stream="rs:exec:x", model=MODEL, context_length=2048, waiting=3, running=running,
        free_kv_tokens=free, total_kv_tokens=1000, cached_tokens=70,
        evictable_tokens=evictable, gen_throughput=123.5,
    )  # fmt: skip


@pytest.fixture
async def gateway_url(redis_url: str, aredis: aioredis.Redis) -> AsyncIterator[str]:
    gw_id = f"gw-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(redis_url=redis_url, instance_id=gw_id, model_name=MODEL)
    metrics = ServiceMetrics("gateway", MODEL, gw_id)
    app = await build_app(settings, r=aredis, metrics=metrics)
    runner = await start_site(app, "127.0.0.1", 0, shutdown_timeout=2.0)
    yield f"http://127.0.0.1:{bound_port(runner)}"
    await runner.cleanup()


GAUGES = {
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
    "sglang:max_total_num_tokens", "sglang:token_usage", "sglang:gen_throughput",
    "radixserve:executor_cached_kv_tokens",
}  # fmt: skip


async def scrape(url: str) -> dict[str, dict[str, float]]:
    """{metric name: {instance_id: value}} of the executors' gauges."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in GAUGES:
            for s in family.samples:
                assert s.labels["model_name"] == MODEL
                out.setdefault(s.name, {})[s.labels["instance_id"]] = s.value
    return out


async def test_executors_without_an_endpoint_are_reported_by_the_gateway(
    gateway_url: str, redis_url: str, aredis: aioredis.Redis
) -> None:
    quiet = Service("executor", "e-quiet", redis_url, load=lambda: load(2, 600, 100))
    scraped = Service("executor", "e-scraped", redis_url, load=lambda: load(5, 100, 0))
    scraped.metrics_port = 9400  # serves its own /metrics: the gateway leaves it out
    try:
        for s in (quiet, scraped):
            await s.beat_once()
        got = await scrape(gateway_url)
        assert got == {
            "sglang:num_running_reqs": {"e-quiet": 2},
            "sglang:num_queue_reqs": {"e-quiet": 3},
            "sglang:num_used_tokens": {"e-quiet": 300},  # 1000 - 600 free - 100 evictable
            "sglang:max_total_num_tokens": {"e-quiet": 1000},
            "sglang:token_usage": {"e-quiet": 0.3},
            "sglang:gen_throughput": {"e-quiet": 123.5},
            "radixserve:executor_cached_kv_tokens": {"e-quiet": 70},
        }
        # the executor gone (its heartbeat key expired): its series go with it
        await aredis.delete(constants.live_key("executor", "e-quiet"))
        assert await scrape(gateway_url) == {}
    finally:
        for s in (quiet, scraped):
            await s.r.aclose()
