"""The aiohttp application: routes, the error middleware, and the reply listener's lifetime."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from aiohttp import web

from services.gateway import (
    abort_api,
    access,
    admin_api,
    embeddings_api,
    health_api,
    info_api,
    input_limits,
    native_api,
    openai_api,
    openapi,
    ready_gate,
    tokenize_api,
)
from services.gateway.access_policy import AccessPolicy
from services.gateway.admission import Admission, watch_load
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import ApiError, default_type, error_body
from services.gateway.executor_gauges import add_executor_gauges
from services.gateway.key_budget import KeyBudget
from services.gateway.metrics import Buckets, GatewayMetrics, endpoint_of
from services.gateway.openai_responses import api as openai_responses_api
from services.gateway.reasoning import think_end
from services.gateway.replies import ReplyRouter
from services.gateway.responses import json_response
from services.gateway.state import STATE, GatewaySettings, GatewayState
from shared import constants
from shared.bus import TRANSIENT, close, connect
from shared.metrics.registry import ServiceMetrics
from shared.metrics.server import metrics_response
from shared.tracing import Tracing

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def count_responses(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every response's status in radixserve:responses_total (outside errors_as_json, so
    errors are counted with the status they left with)."""
    response = await handler(request)
    request.app[STATE].dispatcher.metrics.response("http", endpoint_of(request), response.status)
    return response


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-style JSON body, never an HTML page."""
    if request.app[STATE].draining and request.method == "POST":
        body = error_body("the gateway is shutting down", "server_error", None, 503)
        return json_response(body, 503)
    try:
        return await handler(request)
    except ApiError as e:
        return json_response(e.body(), e.status, e.headers())
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        if e.status < 400:
            raise
        if e.status == 404:
            message = f"no route for {request.method} {request.path}"
        elif e.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        else:
            message = e.text or e.reason
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        body = error_body(message, default_type(e.status), None, e.status)
        return json_response(body, e.status, headers)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return json_response(error_body("internal server error", "server_error", None, 500), 500)


async def build_app(
    settings: GatewaySettings,
    r: aioredis.Redis | None = None,
    access_policy: AccessPolicy | None = None,
    metrics: ServiceMetrics | None = None,
    buckets: Buckets | None = None,
    tracing: Tracing | None = None,
) -> web.Application:
    """The gateway application. `r` is borrowed if given; otherwise the app connects to
    `settings.redis_url` and closes the client at cleanup. The reply listener starts with the
    app (on startup) and stops after in-flight handlers are done (on cleanup). Without
    `access_policy` every caller may do everything (no keys). `metrics` (the service's)
    are served at GET /metrics; without them the gateway counts nothing."""
    owns_client = r is None
    client = connect(settings.redis_url) if r is None else r
    router = ReplyRouter(client, constants.reply_stream(settings.instance_id))
    admission = Admission(settings.max_inflight, settings.max_queued_tokens)
    metrics = metrics or ServiceMetrics("gateway", settings.model_name, "", enabled=False)
    dispatcher = Dispatcher(
        client,
        router,
        router.stream,
        settings.request_timeout_s,
        admission,
        GatewayMetrics(metrics, buckets),
        tracing or Tracing("gateway", settings.instance_id),
        think_end=think_end(settings.reasoning_parser),
    )
    add_executor_gauges(metrics, client)
    metrics.gauge_function(
        "radixserve:inflight_requests",
        "Generations this gateway is waiting on",
        lambda: len(router.queues),
    )
    policy = access_policy or AccessPolicy()
    state = GatewayState(
        settings=settings,
        r=client,
        router=router,
        dispatcher=dispatcher,
        access=policy,
        key_budget=KeyBudget(policy.max_inflight_per_key),
    )
    app = web.Application(
        middlewares=[
            count_responses,
            errors_as_json,
            access.access_control,
            input_limits.body_limit,
            ready_gate.until_ready,
        ],
        client_max_size=settings.max_body_bytes,
    )
    app[STATE] = state

    async def reply_listener(app: web.Application) -> AsyncIterator[None]:
        await router.start()
        state.listener = asyncio.create_task(router.run(), name="reply-listener")
        if admission.max_queued_tokens:
            state.load_watch = asyncio.create_task(watch_load(client, admission), name="load-watch")
        yield
        state.listener.cancel()
        await asyncio.gather(state.listener, return_exceptions=True)
        if state.load_watch is not None:
            state.load_watch.cancel()
            await asyncio.gather(state.load_watch, return_exceptions=True)
        await dispatcher.close()
        try:
            await client.delete(router.stream)  # its one reader is gone
        except TRANSIENT as e:
            log.warning("could not delete %s: %s", router.stream, e)
        await router.reader.close()
        if owns_client:
            await close(client)

    app.cleanup_ctx.append(reply_listener)
    app.cleanup_ctx.append(ready_gate.readiness_ctx)
    openai_api.add_routes(app)
    openai_responses_api.add_routes(app)
    embeddings_api.add_routes(app)
    native_api.add_routes(app)
    admin_api.add_routes(app)
    health_api.add_routes(app)
    abort_api.add_routes(app)
    tokenize_api.add_routes(app)
    info_api.add_routes(app)
    openapi.add_routes(app)

    async def get_metrics(_: web.Request) -> web.Response:
        return await metrics_response(metrics)

    app.router.add_get("/metrics", get_metrics)
    return app


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    shutdown_timeout: float = 30.0,
    reuse_port: bool = False,
) -> web.AppRunner:
    """Serve `app` on host:port (0 picks a free port: see `bound_port`). Handlers are cancelled
    when their client disconnects, which aborts the request downstream. `runner.cleanup()`
    stops accepting, then waits up to `shutdown_timeout` for in-flight requests. With
    `reuse_port` other gateways may listen on the same port (SO_REUSEPORT: the kernel spreads
    new connections over them); without it a port in use is a ListenError."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port).start()
    except OSError as e:  # not a bus outage to wait out: say so and stop
        await runner.cleanup()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return runner


class ListenError(RuntimeError):
    """The gateway cannot bind its port (taken, or not an address of this host): fatal, unlike
    the OSErrors of a Redis outage, which the service waits out."""


def bound_port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])
