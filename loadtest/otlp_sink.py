"""A minimal OTLP/HTTP trace receiver for benchmarks: it accepts what the services' exporters
post to /v1/traces and counts the spans, so tracing is measured with its export really
happening (encoding, HTTP) rather than dropped by an unreachable endpoint."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent: str  # "" for a root
    attrs: dict[str, Any]
    start: int  # unix ns
    end: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class SpanSink:
    """`keep`: also keep every span received (tests), not only the counts."""

    def __init__(self, port: int, keep: bool = False) -> None:
        self.port, self.keep = port, keep
        self.spans = 0
        self.by_name: dict[str, int] = {}
        self.received: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-sink", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _export(self, request: web.Request) -> web.Response:
        body = ExportTraceServiceRequest.FromString(await request.read())
        for rs in body.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans += 1
                        self.by_name[s.name] = self.by_name.get(s.name, 0) + 1
                        if self.keep:
                            self.received.append(
                                ReceivedSpan(
                                    resource.get("service.name", ""),
                                    s.name,
                                    s.trace_id.hex(),
                                    s.span_id.hex(),
                                    s.parent_span_id.hex(),
                                    {a.key: _value(a.value) for a in s.attributes},
                                    s.start_time_unix_nano,
                                    s.end_time_unix_nano,
                                )
                            )
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
