"""OpenTelemetry spans, one trace per request across every service (--otlp-traces-endpoint).

Every request carries a W3C `traceparent` (Trace.traceparent). The gateway's span for the
client's request is the parent of every other service's span, so each service reads the
parent from the message it got and records its own span under it:

    tracing = Tracing.from_flags(args, "tokenizer", instance)
    tracing.record("tokenize", trace.traceparent, start, end, {"rid": rid})

Spans are recorded when the work they cover is over, with its start and end times (unix
seconds, as the hop stamps are), so no span object lives across awaits or steps. Export is
batched on the SDK's own thread. Off (no endpoint), `Tracing.on` is False and every call
returns at once: nothing is imported, allocated or exported.
"""

from __future__ import annotations

import argparse
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

Attributes = Mapping[str, str | int | float | bool]
PROTOCOLS = ["http/protobuf", "grpc"]


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def span_traceparent(span: Any) -> str:
    """The W3C traceparent naming `span` as the parent."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def fresh_traceparent() -> str:
    """A new trace's context, for a request that came without one (tracing off: carried for
    the logs' sake; on, the gateway's span starts the trace instead)."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class Tracing:
    def __init__(
        self,
        service: str,
        instance: str,
        endpoint: str = "",
        protocol: str = "http/protobuf",
        exporter: Any = None,
    ) -> None:
        """Spans go to `endpoint` over `protocol`, or to `exporter` (tests: the SDK's
        InMemorySpanExporter, exported synchronously); neither: off."""
        self.on = bool(endpoint) or exporter is not None
        self.service = service
        self._provider: Any = None
        self._tracer: Any = None
        if not self.on:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create(
            {
                "service.name": f"radixserve-{service}",
                "service.namespace": "radixserve",
                "service.instance.id": instance,
            }
        )
        self._provider = TracerProvider(resource=resource)
        if exporter is not None:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            self._provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint, protocol)))
        self._tracer = self._provider.get_tracer("radixserve")
        self._propagator = TraceContextTextMapPropagator()
        log.info("tracing: spans to %s (%s)", endpoint or "a test exporter", protocol)

    @classmethod
    def from_flags(cls, a: argparse.Namespace, service: str, instance: str) -> Tracing:
        return cls(service, instance, a.otlp_traces_endpoint, a.otlp_traces_protocol)

    def _context(self, parent: str) -> Any:
        return self._propagator.extract({"traceparent": parent}) if parent else None

    def start(
        self,
        name: str,
        parent: str,
        start: float | None = None,
        attributes: Attributes | None = None,
        server: bool = False,
    ) -> Any:
        """An open span (end it with `span.end()`): for work whose children need its
        traceparent before it ends. None when off."""
        if not self.on:
            return None
        from opentelemetry.trace import SpanKind

        return self._tracer.start_span(
            name,
            context=self._context(parent),
            kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
            attributes=attributes,
            start_time=None if start is None else _ns(start),
        )

    def record(
        self,
        name: str,
        parent: str,
        start: float,
        end: float,
        attributes: Attributes | None = None,
        events: Sequence[tuple[str, float, Attributes]] = (),
    ) -> str:
        """A finished span from `start` to `end` under `parent`; its traceparent ("" off)."""
        if not self.on:
            return ""
        span = self._tracer.start_span(
            name, context=self._context(parent), attributes=attributes, start_time=_ns(start)
        )
        for event, at, attrs in events:
            span.add_event(event, attrs, timestamp=_ns(at))
        span.end(end_time=_ns(max(start, end)))
        return span_traceparent(span)

    def shutdown(self) -> None:
        """Export what is batched and stop (a service's last act)."""
        if self._provider is not None:
            self._provider.shutdown()


def _exporter(endpoint: str, protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    # The HTTP exporter posts to the URL as given: a bare collector address gets the path
    # collectors serve traces on.
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    if url.rstrip("/").count("/") <= 2:
        url = url.rstrip("/") + "/v1/traces"
    return Http(endpoint=url)
