"""Executors' gauges on the gateway's /metrics, for executors that serve no metrics of their
own (no --metrics-port: `radixserve serve`'s default), read from their heartbeats when
Prometheus scrapes.

SGLang and vLLM serve their scheduler's gauges (running and queued requests, KV usage) on the
API port's /metrics; here those live in the executor process, which without --metrics-port
has no endpoint. So the gateway reports them under the executor's own labels (its model name
and instance id), exactly as the executor would: one series per executor, whichever endpoint
it comes from. An executor that serves its own /metrics is left out here, so that scraping
both never counts it twice. The radix cache's hit rate is not in a heartbeat: only the
executor's own endpoint reports `sglang:cache_hit_rate`.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis.asyncio as aioredis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.messages.heartbeat import ExecutorLoad
from shared.metrics.executor_load import load_gauges
from shared.metrics.registry import COMMON_LABELS, ServiceMetrics
from shared.service import live_instances

THROUGHPUT_HELP = "Tokens generated per second (over the executor's recent heartbeats)"


class ExecutorGauges(Collector):
    def __init__(self, r: aioredis.Redis) -> None:
        self.r = r
        self.loads: list[tuple[str, ExecutorLoad]] = []  # (instance, load) at the last refresh

    async def refresh(self) -> None:
        """The live executors without a metrics endpoint of their own, by instance name."""
        beats = await live_instances(self.r, "executor")
        self.loads = sorted(
            (b.instance, b.executor)
            for b in beats
            if b.executor is not None and b.metrics_port == 0
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # which names appear depends on the executors live at a scrape

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for instance, load in self.loads:
            gauges = [
                *load_gauges(load),
                ("sglang:gen_throughput", THROUGHPUT_HELP, load.gen_throughput),
            ]
            for name, doc, value in gauges:
                family = families.get(name)
                if family is None:
                    family = families[name] = GaugeMetricFamily(
                        name, doc, labels=list(COMMON_LABELS)
                    )
                family.add_metric([load.model, instance], value)
        yield from families.values()


def add_executor_gauges(metrics: ServiceMetrics, r: aioredis.Redis) -> None:
    """Report live executors' gauges on `metrics` (nothing when metrics are off)."""
    if not metrics.enabled:
        return
    gauges = ExecutorGauges(r)
    metrics.register(gauges)
    metrics.refreshers.append(gauges.refresh)
