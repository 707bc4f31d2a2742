"""A minimal OTLP/HTTP trace receiver for benchmarks: it accepts what the services' exporters
post to /v1/traces and counts the spans, so tracing is measured with its export really
happening (encoding, HTTP) rather than dropped by an unreachable endpoint."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class SpanSink:
    def __init__(self, port: int) -> None:
        self.port = port
        self.spans = 0
        self.by_name: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-sink", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _export(self, request: web.Request) -> web.Response:
        body = ExportTraceServiceRequest.FromString(await request.read())
        for rs in body.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans += 1
                    self.by_name[s.name] = self.by_name.get(s.name, 0) + 1
        reply = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._export)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def start(self) -> SpanSink:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the OTLP sink did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
