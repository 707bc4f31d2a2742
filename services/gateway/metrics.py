"""The gateway's metrics: SGLang's request metrics (time to first token, inter-token latency,
end-to-end latency, time per output token, token counts), where each request's first token
spent its time (the hop stages), and responses by status code for HTTP and gRPC alike.

Every generation passes through a Pending (dispatch.py), whatever front door it came in by;
`RequestClock` rides on it and times what the client sees: from the gateway taking the
request to each reply the handler takes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from services.gateway.hop_stats import STAGES
from shared.messages.reply import Delta, GenerationReply
from shared.metrics import buckets
from shared.metrics.buckets import SERVICE_SECONDS
from shared.metrics.registry import ServiceMetrics


@dataclass(frozen=True)
class Buckets:
    """--bucket-* flags (SGLang's names and defaults)."""

    time_to_first_token: tuple[float, ...] = buckets.TIME_TO_FIRST_TOKEN
    inter_token_latency: tuple[float, ...] = buckets.INTER_TOKEN_LATENCY
    e2e_request_latency: tuple[float, ...] = buckets.E2E_REQUEST_LATENCY
    time_per_output_token: tuple[float, ...] = buckets.TIME_PER_OUTPUT_TOKEN


class GatewayMetrics:
    def __init__(self, m: ServiceMetrics, b: Buckets | None = None) -> None:
        b = b or Buckets()
        self.enabled = m.enabled
        self.requests = m.counter("sglang:num_requests_total", "Requests that ended")
        self.aborted = m.counter(
            "sglang:num_aborted_requests_total",
            "Requests that ended before their answer (client gone, deadline, error)",
        )
        self.prompt_tokens = m.counter(
            "sglang:prompt_tokens_total", "Prompt tokens of the requests that ended"
        )
        self.generation_tokens = m.counter(
            "sglang:generation_tokens_total", "Generated tokens of the requests that ended"
        )
        self.cached_tokens = m.counter(
            "sglang:cached_tokens_total", "Prompt tokens whose KV came from the radix cache"
        )
        self.ttft = m.histogram(
            "sglang:time_to_first_token_seconds",
            "Time from the gateway taking a request to its first token reaching the handler",
            b.time_to_first_token,
        )
        self.itl = m.histogram(
            "sglang:inter_token_latency_seconds",
            "Time between tokens as the handler receives them (a delta of n tokens counts n "
            "intervals of 1/n of its wait)",
            b.inter_token_latency,
        )
        self.e2e = m.histogram(
            "sglang:e2e_request_latency_seconds",
            "Time from the gateway taking a request to its last reply",
            b.e2e_request_latency,
        )
        self.tpot = m.histogram(
            "sglang:time_per_output_token_seconds",
            "Decode time per output token after the first: (e2e - ttft) / (tokens - 1)",
            b.time_per_output_token,
        )
        stage = m.histogram(
            "radixserve:first_token_stage_seconds",
            "Where requests' first tokens spent their time, by hop stage (services/gateway/"
            "hop_stats.py)",
            SERVICE_SECONDS,
            ["stage"],
        )
        self.stages = {name: stage.labels(name) for name, _, _ in STAGES}
        self.responses = m.counter(
            "radixserve:responses",
            "Responses by protocol, endpoint and status (HTTP code or gRPC status name)",
            ["protocol", "endpoint", "code"],
        )

    def first_token_stages(self, stages_ms: dict[str, float]) -> None:
        for name, ms in stages_ms.items():
            child = self.stages.get(name)
            if child is not None:
                child.observe(ms / 1000.0)

    def response(self, protocol: str, endpoint: str, code: int | str) -> None:
        self.responses.labels(protocol, endpoint, str(code)).inc()


class RequestClock:
    """One request's timings as the handler takes its replies."""

    __slots__ = ("ended", "first", "last", "metrics", "started", "tokens")

    def __init__(self, metrics: GatewayMetrics, started: float) -> None:
        self.metrics, self.started = metrics, started
        self.first = self.last = 0.0
        self.tokens = 0
        self.ended = False

    def seen(self, reply: GenerationReply) -> None:
        if self.ended or not self.metrics.enabled:
            return
        now = time.time()
        m = self.metrics
        if not isinstance(reply, Delta):  # a Failure ends it without an answer
            self.end(now)
            return
        n = len(reply.token_ids)
        if n:
            if not self.first:
                self.first = self.last = now
                m.ttft.observe(now - self.started)
                n -= 1  # the first token has no interval before it
            if n > 0:
                step = (now - self.last) / n
                for _ in range(n):
                    m.itl.observe(step)
            self.last = now
            self.tokens += len(reply.token_ids)
        if reply.finish_reason is not None:
            self.ended = True
            m.requests.inc()
            m.e2e.observe(now - self.started)
            usage = reply.usage
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.generation_tokens.inc(usage.completion_tokens)
            m.cached_tokens.inc(usage.cached_tokens)
            if self.first and usage.completion_tokens > 1:
                m.tpot.observe((now - self.first) / (usage.completion_tokens - 1))

    def end(self, now: float | None = None) -> None:
        """The request ended without its final delta (failed, aborted, timed out)."""
        if self.ended or not self.metrics.enabled:
            return
        self.ended = True
        now = time.time() if now is None else now
        self.metrics.requests.inc()
        self.metrics.aborted.inc()
        self.metrics.e2e.observe(now - self.started)


def endpoint_of(request: web.Request) -> str:
    """The route's path template (unknown paths as one label, not one each)."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "unmatched"
