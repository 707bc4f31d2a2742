"""The HTTP endpoint every service opens on --metrics-port:

    GET /metrics   Prometheus text (the refreshers' Redis reads run first, bounded in time)
    GET /health    200 while the service's loop runs and its heartbeat reached Redis lately

`/health` is what an orchestrator's liveness probe asks: it answers from memory, so a slow
Redis makes it fail only once heartbeats stop getting through, as the bus's own liveness
rule (the heartbeat key's TTL) would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from shared.bus import TRANSIENT
from shared.metrics.registry import ServiceMetrics

log = logging.getLogger(__name__)

# A scrape waits this long for gauges read from Redis, then reports what it has.
REFRESH_TIMEOUT_S = 2.0


async def refresh(metrics: ServiceMetrics) -> None:
    """Run every refresher; one failing (Redis away) leaves its gauges at their last values."""
    if not metrics.refreshers:
        return
    try:
        async with asyncio.timeout(REFRESH_TIMEOUT_S):  # keeps a cancel, unlike 3.11's wait_for
            results = await asyncio.gather(
                *(f() for f in metrics.refreshers), return_exceptions=True
            )
    except TimeoutError:
        log.debug("metrics refresh timed out")
        return
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, TRANSIENT):
            log.warning("metrics refresh failed: %r", r)


async def metrics_response(metrics: ServiceMetrics) -> web.Response:
    await refresh(metrics)
    body = metrics.text()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def metrics_app(metrics: ServiceMetrics, healthy: Callable[[], str | None]) -> web.Application:
    """`healthy()` returns None when healthy, else why not."""

    async def get_metrics(_: web.Request) -> web.Response:
        return await metrics_response(metrics)

    async def get_health(_: web.Request) -> web.Response:
        problem = healthy()
        if problem is None:
            return web.json_response({"status": "ok", "service": metrics.service})
        return web.json_response(
            {"status": "unhealthy", "service": metrics.service, "reason": problem}, status=503
        )

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/health", get_health)
    return app


async def start_metrics_server(
    metrics: ServiceMetrics, healthy: Callable[[], str | None], host: str, port: int
) -> web.AppRunner:
    runner = web.AppRunner(metrics_app(metrics, healthy), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise SystemExit(
            f"{metrics.service}: cannot serve metrics on {host}:{port} (--metrics-port): {e}"
        ) from None
    log.info("metrics on http://%s:%d/metrics", host, port)
    return runner
