"""The scheduler's metrics, read from its router at scrape time (the router runs on the same
event loop, so the reads never race it)."""

from __future__ import annotations

from services.scheduler.router import Router
from shared.metrics.registry import ServiceMetrics


def scheduler_metrics(m: ServiceMetrics, router: Router) -> None:
    stats = router.stats
    m.counter_function(
        "radixserve:scheduler_routed_total",
        "Requests sent to each executor (by its instance id)",
        lambda: {(name,): n for name, n in stats.routed.items()},
        ["executor"],
    )
    m.counter_function(
        "radixserve:scheduler_redispatched_total",
        "Requests routed again because the executor holding them was lost",
        lambda: stats.resumed,
    )
    m.counter_function(
        "radixserve:scheduler_refused_total",
        "Requests the scheduler ended instead of routing, by HTTP status (503: no executor or "
        "queue full; 504: past their deadline; abort: aborted before routing)",
        lambda: {(code,): n for code, n in stats.ended.items()},
        ["code"],
    )
    m.gauge_function(
        "radixserve:scheduler_live_executors",
        "Executors whose heartbeats the scheduler (when leading) sees",
        lambda: len(router.executors),
    )
    m.gauge_function(
        "radixserve:scheduler_inflight_requests",
        "Requests routed and not finished yet, all executors together",
        lambda: len(router.assigned),
    )
