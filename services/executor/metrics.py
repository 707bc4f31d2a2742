"""The executor's metrics. The engine keeps plain totals (engine/stats.py) and the step loop
observes one step time per step; everything else is read when Prometheus scrapes, so the
stepping thread pays nothing per token and nothing per request.

Rates (sglang:gen_throughput, sglang:cache_hit_rate) are taken over the last RATE_WINDOW_S of
scrapes: between two scrapes at least MIN_SPAN_S apart, the newest and the oldest still in
the window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.executor.engine.loop import Engine
from services.executor.engine.stats import PHASES
from services.executor.rates import RATE_WINDOW_S, Window
from shared.metrics.buckets import SERVICE_SECONDS
from shared.metrics.executor_load import load_gauges
from shared.metrics.registry import COMMON_LABELS, ServiceMetrics


class ExecutorCollector(Collector):
    def __init__(self, engine: Engine, common: tuple[str, ...]) -> None:
        self.engine, self.common = engine, common
        self.window = Window()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(COMMON_LABELS))
        g.add_metric(list(self.common), value)
        return g

    def _counter(
        self, name: str, doc: str, values: dict[tuple[str, ...], float], label: str = ""
    ) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=[*COMMON_LABELS, *([label] if label else [])])
        for extra, value in values.items():
            c.add_metric([*self.common, *extra], value)
        return c

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())  # names are only known by collecting; the registry need not check

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        e = self.engine
        load, stats = e.load(), e.stats
        self.window.add(
            time.monotonic(), stats.generated_tokens, stats.prompt_tokens, stats.cached_tokens
        )
        for name, doc, value in load_gauges(load):
            yield self._gauge(name, doc, value)
        yield self._gauge(
            "sglang:cache_hit_rate",
            f"Fraction of prompt tokens found in the radix cache (last {RATE_WINDOW_S:g} s)",
            self.window.hit_rate,
        )
        yield self._gauge(
            "sglang:gen_throughput",
            f"Tokens generated per second (last {RATE_WINDOW_S:g} s)",
            self.window.throughput,
        )
        yield self._counter(
            "radixserve:executor_forward_tokens",
            "Tokens run through the model, by step phase",
            {(phase,): n for phase, n in stats.tokens_by_phase().items()},
            "phase",
        )
        yield self._counter(
            "radixserve:executor_generated_tokens",
            "Sampled tokens that reached the host",
            {(): stats.generated_tokens},
        )
        yield self._counter(
            "radixserve:executor_prompt_tokens",
            "Prompt tokens of finished requests",
            {(): stats.prompt_tokens},
        )
        yield self._counter(
            "radixserve:executor_cached_tokens",
            "Prompt tokens of finished requests whose KV came from the radix cache",
            {(): stats.cached_tokens},
        )
        yield self._counter(
            "radixserve:executor_retractions",
            "Running requests sent back to the queue because the KV pool ran out",
            {(): e.policy.num_retracted},
        )
        yield self._counter(
            "radixserve:executor_evicted_tokens",
            "Cached KV tokens evicted to make room",
            {(): e.policy.mem.cache.evicted_tokens},
        )
        yield self._counter(
            "radixserve:executor_aborts",
            "Requests ended early, by reason (abort: the client went; stop: a stop string "
            "matched; deadline; bus_restart: Redis restarted empty)",
            {(reason,): n for reason, n in list(stats.aborts.items())},
            "reason",
        )


class StepTimer:
    """Host time of each engine step, by the phase of the step it launched (PHASES)."""

    def __init__(self, m: ServiceMetrics) -> None:
        h = m.histogram(
            "radixserve:executor_step_seconds",
            "Host time of one engine step (plan, launch, and landing the step before), by "
            "the phase of the step launched: decode, extend, or extend_rows (an extend run "
            "as decode rows from the CUDA graphs)",
            SERVICE_SECONDS,
            ["phase"],
        )
        self.phases = {phase: h.labels(phase) for phase in PHASES}

    def observe(self, seconds: float, phase: str) -> None:
        """One step's host time; phase "" (nothing launched) is not observed."""
        if phase:
            self.phases[phase].observe(seconds)


def executor_metrics(m: ServiceMetrics, engine: Engine) -> StepTimer:
    m.register(ExecutorCollector(engine, m.common))
    return StepTimer(m)
