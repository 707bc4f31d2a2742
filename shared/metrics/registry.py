"""One process's metrics, every one labelled with the model and the service instance.

    m = ServiceMetrics("tokenizer", model_name, instance_id)
    seconds = m.histogram("radixserve:tokenize_seconds", "...", buckets=...)
    seconds.observe(0.002)                         # the common labels are bound already
    by_kind = m.counter("radixserve:tokenizer_requests", "...", ["kind"])
    by_kind.labels("generate").inc()

The instance's label is `instance_id`, not `instance`: Prometheus sets `instance` itself (the
scrape target) and would rename ours to `exported_instance`.

Disabled (`--no-enable-metrics`), every metric is a shared no-op, so the code that updates
them never branches and costs one method call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# `_created` series double every counter's and histogram's series for a timestamp nobody
# graphs; SGLang's endpoints do without them too.
disable_created_metrics()

COMMON_LABELS = ("model_name", "instance_id")


class Metric(Protocol):
    """What the services call on a metric (a prometheus_client child or the no-op)."""

    def inc(self, amount: float = 1) -> None: ...
    def set(self, value: float) -> None: ...
    def observe(self, amount: float) -> None: ...


class _Noop:
    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def labels(self, *values: str) -> _Noop:
        return self


NOOP = _Noop()


class Family:
    """A metric with labels of its own beyond the common two: `labels(*values)` gives the
    child for those values, cached (prometheus_client's own lookup takes a lock each time)."""

    def __init__(self, metric: Any, common: tuple[str, ...]) -> None:
        self._metric, self._common = metric, common
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._metric.labels(*self._common, *values)
            self._children[values] = child
        return child


class ServiceMetrics:
    def __init__(self, service: str, model_name: str, instance_id: str, enabled: bool = True):
        self.service, self.enabled = service, enabled
        self.common = (model_name, instance_id)
        self.registry = CollectorRegistry(auto_describe=True)
        if enabled:
            ProcessCollector(registry=self.registry)
        # Awaited before each scrape: gauges read from Redis (stream lengths) are set here.
        self.refreshers: list[Callable[[], Awaitable[None]]] = []

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._make(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._make(Gauge, name, doc, labels)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Any:
        return self._make(Histogram, name, doc, labels, buckets=buckets)

    def gauge_function(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge whose value is read at scrape time (no cost between scrapes)."""
        if self.enabled:
            self._make(Gauge, name, doc, ()).set_function(read)

    def register(self, collector: Collector) -> None:
        """A custom collector (values read at scrape time); nothing when disabled."""
        if self.enabled:
            self.registry.register(collector)

    def counter_function(
        self,
        name: str,
        doc: str,
        read: Callable[[], float | Mapping[tuple[str, ...], float]],
        labels: Sequence[str] = (),
    ) -> None:
        """A counter whose value is a total kept elsewhere (a service's own statistics), read
        at scrape time: no cost where it is counted. With `labels`, `read` maps label values
        to totals."""
        if self.enabled:
            self.registry.register(_ReadCounter(name, doc, read, self.common, tuple(labels)))

    def _make(self, kind: Any, name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
        if not self.enabled:
            return NOOP
        metric = kind(name, doc, [*COMMON_LABELS, *labels], registry=self.registry, **kw)
        return Family(metric, self.common) if labels else metric.labels(*self.common)

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _ReadCounter(Collector):
    def __init__(
        self,
        name: str,
        doc: str,
        read: Callable[[], float | Mapping[tuple[str, ...], float]],
        common: tuple[str, ...],
        labels: tuple[str, ...],
    ) -> None:
        self.name, self.doc, self.read = name.removesuffix("_total"), doc, read
        self.common, self.labels = common, labels

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.doc, labels=[*COMMON_LABELS, *self.labels])

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=[*COMMON_LABELS, *self.labels])
        value = self.read()
        if isinstance(value, Mapping):
            for values, total in value.items():
                family.add_metric([*self.common, *values], total)
        else:
            family.add_metric(list(self.common), value)
        yield family
