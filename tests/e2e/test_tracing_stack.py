"""One OpenTelemetry trace per request across all six services, exported by each service's
real OTLP/HTTP exporter (--otlp-traces-endpoint) to a receiver in this test (the benchmarks'
loadtest/otlp_sink.py), which decodes the collector protocol's protobuf as a collector would."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtest.otlp_sink import ReceivedSpan, SpanSink
from tests.conftest import free_port
from tests.e2e.stack import Stack, start_stack
from tests.e2e.test_control_endpoints import MODEL

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


Span = ReceivedSpan


class Receiver(SpanSink):
    """The benchmark's OTLP/HTTP receiver, keeping every span, and waiting for a trace."""

    def __init__(self) -> None:
        super().__init__(free_port(), keep=True)

    def wait_for(self, names: set[str], rid: str, timeout: float = 60.0) -> list[Span]:
        """The spans of the trace whose gateway span has `rid`, once it holds `names`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                roots = [
                    s for s in self.received if s.name == "request" and s.attrs.get("rid") == rid
                ]
                spans = [s for s in self.received if roots and s.trace_id == roots[0].trace_id]
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.1)
        with self.lock:
            seen = sorted({(s.service, s.name) for s in self.received})
        raise AssertionError(f"the trace of {rid} never held {sorted(names)}; saw {seen}")


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced_stack(
    redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, receiver: Any
) -> Iterator[Stack]:
    stack = start_stack(
        [
            "--model",
            str(tiny_model_dir),
            "--max-total-tokens",
            "4096",
            "--otlp-traces-endpoint",
            f"http://127.0.0.1:{receiver.port}",
        ],
        tmp_path_factory.mktemp("logs") / "traced-stack.log",
        redis_url.rsplit("/", 1)[0] + "/4",
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # the SDK's batch interval (default 5 s)
    )
    yield stack
    assert stack.stop() == 0, stack.log_tail()


EVERY_SPAN = {
    "request",
    "reply",
    "tokenize",
    "grammar",
    "route",
    "executor",
    "queue",
    "prefill",
    "prefill_chunk",
    "decode",
    "detokenize",
}
SERVICE_OF = {
    "request": "gateway",
    "reply": "gateway",
    "tokenize": "tokenizer",
    "grammar": "grammar",
    "route": "scheduler",
    "executor": "executor",
    "queue": "executor",
    "prefill": "executor",
    "prefill_chunk": "executor",
    "decode": "executor",
    "detokenize": "detokenizer",
}
PARENT_OF = {
    "reply": "request",
    "tokenize": "request",
    "grammar": "request",
    "route": "request",
    "executor": "request",
    "detokenize": "request",
    "queue": "executor",
    "prefill": "executor",
    "decode": "executor",
    "prefill_chunk": "prefill",
}


def by_name(spans: list[Span]) -> dict[str, Span]:
    one = {s.name: s for s in spans if s.name != "prefill_chunk"}
    assert len(one) == len([s for s in spans if s.name != "prefill_chunk"]), spans
    return one


def test_one_trace_across_every_service_under_the_clients_traceparent(
    traced_stack: Stack, receiver: Receiver
) -> None:
    client = openai.OpenAI(base_url=f"{traced_stack.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a number please"}],
        max_tokens=12,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
    )
    rid = reply.id.removeprefix("chatcmpl-")
    spans = receiver.wait_for(EVERY_SPAN, rid)
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}  # one trace: the client's
    named = by_name(spans)
    ids = {s.span_id: s for s in spans}
    for s in spans:
        assert s.service == f"radixserve-{SERVICE_OF[s.name]}", s
        assert s.start <= s.end, s
    root = named["request"]
    assert root.parent == CLIENT_SPAN  # the client's span is the gateway's parent
    for s in spans:
        if s.name in PARENT_OF:
            assert ids[s.parent].name == PARENT_OF[s.name], (s.name, ids[s.parent].name)
    usage = reply.usage
    assert usage is not None
    assert root.attrs["prompt_tokens"] == usage.prompt_tokens
    assert root.attrs["completion_tokens"] == usage.completion_tokens
    assert root.attrs["cached_tokens"] == (
        usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    )
    executor = named["executor"]
    assert executor.attrs["prompt_tokens"] == usage.prompt_tokens
    assert executor.attrs["completion_tokens"] == usage.completion_tokens
    # the prompt's chunks (with the text the grammar forces at the start, computed with it)
    chunks = [s for s in spans if s.name == "prefill_chunk"]
    assert sum(c.attrs["tokens"] for c in chunks) >= usage.prompt_tokens
    # the request's rid names it in every service's span
    assert all(s.attrs.get("rid") == rid for s in spans if "rid" in s.attrs)
    assert named["route"].attrs["executor"]


def test_a_request_without_traceparent_starts_its_own_trace(
    traced_stack: Stack, receiver: Receiver
) -> None:
    client = openai.OpenAI(base_url=f"{traced_stack.base_url}/v1", api_key="x", max_retries=0)
    first = client.completions.create(model=MODEL, prompt="one", max_tokens=3, temperature=0)
    second = client.completions.create(model=MODEL, prompt="two", max_tokens=3, temperature=0)
    unconstrained = EVERY_SPAN - {"grammar"}
    a = receiver.wait_for(unconstrained, first.id.removeprefix("cmpl-"))
    b = receiver.wait_for(unconstrained, second.id.removeprefix("cmpl-"))
    assert a[0].trace_id != b[0].trace_id
    for spans, answer in ((a, first), (b, second)):
        named = by_name(spans)
        assert named["request"].parent == ""  # a root
        assert "grammar" not in named  # no constraint: no grammar hop
        assert answer.usage is not None
        computed = answer.usage.prompt_tokens - named["executor"].attrs["cached_tokens"]
        assert sum(s.attrs["tokens"] for s in spans if s.name == "prefill_chunk") == computed
