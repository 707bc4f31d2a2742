"""Spans through the SDK's in-memory exporter: the parent each service's span takes from the
traceparent it was given, the executor's and the gateway's span trees, and nothing at all
when tracing is off."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.executor.engine.timeline import Finished, Timeline
from services.executor.tracing import record_request
from services.gateway.tracing import RequestSpan
from shared.messages.common import ErrorInfo
from shared.messages.reply import Delta, Failure, Usage
from shared.tracing import Tracing, _exporter, fresh_traceparent

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PARENT = f"00-{TRACE}-{SPAN}-01"


def traced(service: str = "x") -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing(service, "i-1", exporter=exporter), exporter


def ids(span: ReadableSpan) -> tuple[str, str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent.span_id if span.parent is not None else None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{parent:016x}" if parent else ""


def test_off_records_nothing_and_carries_nothing() -> None:
    off = Tracing("tokenizer", "i-1")
    assert not off.on
    assert off.record("tokenize", PARENT, 1.0, 2.0, {"rid": "a"}) == ""
    assert off.start("request", PARENT) is None
    off.shutdown()


def test_a_span_joins_the_trace_it_was_given() -> None:
    tracing, exported = traced("tokenizer")
    child = tracing.record("tokenize", PARENT, 100.0, 100.25, {"rid": "a", "prompt_tokens": 7})
    tracing.record("inner", child, 100.1, 100.2)
    outer, inner = exported.get_finished_spans()
    assert ids(outer)[0] == TRACE and ids(outer)[2] == SPAN
    assert ids(inner)[0] == TRACE and ids(inner)[2] == ids(outer)[1]
    assert child == f"00-{TRACE}-{ids(outer)[1]}-01"
    assert (outer.start_time, outer.end_time) == (100_000_000_000, 100_250_000_000)
    assert outer.attributes == {"rid": "a", "prompt_tokens": 7}
    assert outer.resource.attributes["service.name"] == "radixserve-tokenizer"
    assert outer.resource.attributes["service.instance.id"] == "i-1"


def test_without_a_parent_a_span_starts_a_trace() -> None:
    tracing, exported = traced()
    tracing.record("alone", "", 1.0, 2.0)
    (span,) = exported.get_finished_spans()
    assert span.parent is None


def attrs(span: ReadableSpan) -> Any:
    assert span.attributes is not None
    return span.attributes


def test_the_executor_span_tree() -> None:
    tracing, exported = traced("executor")
    timeline = Timeline(PARENT, inbox=10.0, chunks=[(10.5, 64), (10.7, 36)], first_token=10.9)
    timeline.finished = 12.0
    record_request(tracing, Finished("r1", timeline, 100, 0, 20, "length"))
    spans = {s.name: s for s in exported.get_finished_spans() if s.name != "prefill_chunk"}
    chunks = [s for s in exported.get_finished_spans() if s.name == "prefill_chunk"]
    executor = spans["executor"]
    assert ids(executor)[2] == SPAN
    for name in ("queue", "prefill", "decode"):
        assert ids(spans[name])[2] == ids(executor)[1], name
    assert all(ids(c)[2] == ids(spans["prefill"])[1] for c in chunks)
    assert [(c.start_time, c.end_time, attrs(c)["tokens"]) for c in chunks] == [
        (10_500_000_000, 10_700_000_000, 64),
        (10_700_000_000, 10_900_000_000, 36),
    ]
    assert spans["queue"].end_time == 10_500_000_000
    assert spans["decode"].start_time == 10_900_000_000
    assert attrs(executor)["completion_tokens"] == 20


def test_a_request_that_never_ran_has_only_its_queue() -> None:
    tracing, exported = traced("executor")
    timeline = Timeline(PARENT, inbox=10.0)
    timeline.finished = 11.0
    record_request(tracing, Finished("r1", timeline, 100, 0, 0, "abort"))
    assert sorted(s.name for s in exported.get_finished_spans()) == ["executor", "queue"]


def test_the_gateway_span_carries_the_answer_and_parents_the_reply() -> None:
    tracing, exported = traced("gateway")
    span = RequestSpan(tracing, PARENT, 50.0, {"rid": "r1"})
    usage = Usage(prompt_tokens=5, completion_tokens=1)
    first = Delta(rid="r1", text="a", token_ids=[1], usage=usage)
    last = Delta(
        rid="r1",
        text="b",
        token_ids=[2],
        usage=Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=3),
        finish_reason="stop",
    )
    span.seen(first)
    span.seen(last)
    span.end()
    reply, request = exported.get_finished_spans()
    assert (reply.name, request.name) == ("reply", "request")
    assert ids(request)[2] == SPAN and ids(reply)[2] == ids(request)[1]
    assert span.traceparent == f"00-{TRACE}-{ids(request)[1]}-01"
    assert request.attributes == {
        "rid": "r1",
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "cached_tokens": 3,
        "finish_reason": "stop",
    }


def test_a_failed_request_says_why() -> None:
    tracing, exported = traced("gateway")
    span = RequestSpan(tracing, "", 50.0, {"rid": "r1"})
    span.seen(Failure(rid="r1", error=ErrorInfo(status=503, message="no executor")))
    span.end()
    (request,) = exported.get_finished_spans()  # no token: no reply span
    assert attrs(request)["error_status"] == 503
    dropped = RequestSpan(tracing, "", 50.0, {"rid": "r2"})
    dropped.end("client disconnected")
    assert attrs(exported.get_finished_spans()[-1])["ended"] == "client disconnected"


@pytest.mark.parametrize(
    ("endpoint", "protocol", "kind", "url"),
    [
        ("http://collector:4318", "http/protobuf", Http, "http://collector:4318/v1/traces"),
        ("collector:4318", "http/protobuf", Http, "http://collector:4318/v1/traces"),
        ("http://c:4318/custom/path", "http/protobuf", Http, "http://c:4318/custom/path"),
        ("collector:4317", "grpc", Grpc, None),
    ],
)
def test_the_exporter_follows_the_protocol(
    endpoint: str, protocol: str, kind: Any, url: str | None
) -> None:
    exporter: Any = _exporter(endpoint, protocol)
    assert isinstance(exporter, kind)
    if url is not None:
        assert exporter._endpoint == url
    exporter.shutdown()


def test_fresh_traceparents_are_well_formed_and_new() -> None:
    a, b = fresh_traceparent(), fresh_traceparent()
    assert a != b and len(a) == 55 and a.startswith("00-") and a.endswith("-01")
