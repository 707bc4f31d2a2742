"""The tokenizer's metrics (calls by kind, how long each took in its thread pool) and its span
of each generation (tokenize, under the gateway's span of the request)."""

from __future__ import annotations

import time

from services.tokenizer.core import Tokenization
from services.tokenizer.handlers import Out, handle
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import AbortRequest, GenerateRequest, TokenizeMessage, TokenizeRequest
from shared.metrics.buckets import SERVICE_SECONDS
from shared.metrics.registry import ServiceMetrics
from shared.tracing import Tracing


def kind_of(msg: TokenizeMessage) -> str:
    if isinstance(msg, GenerateRequest):
        return "generate"
    if isinstance(msg, TokenizeRequest):
        return "tokenize"
    return "abort" if isinstance(msg, AbortRequest) else "detokenize"


class TokenizerMetrics:
    def __init__(self, m: ServiceMetrics, tracing: Tracing | None = None) -> None:
        self.tracing = tracing or Tracing("tokenizer", "")
        self.requests = m.counter(
            "radixserve:tokenizer_requests", "Messages the tokenizer handled, by kind", ["kind"]
        )
        self.seconds = m.histogram(
            "radixserve:tokenize_seconds",
            "Time to handle one message (tokenize a prompt, check it, build its messages)",
            SERVICE_SECONDS,
        )

    def handle(self, tok: Tokenization, msg: TokenizeMessage, partitions: int) -> Out:
        """handlers.handle, counted and timed (runs in the tokenizer's threads)."""
        started, wall = time.perf_counter(), time.time()
        out = handle(tok, msg, partitions)
        self.seconds.observe(time.perf_counter() - started)
        self.requests.labels(kind_of(msg)).inc()
        if self.tracing.on and isinstance(msg, GenerateRequest):
            tokenized = next((m for _, m in out if isinstance(m, TokenizedRequest)), None)
            self.tracing.record(
                "tokenize",
                msg.trace.traceparent,
                wall,
                time.time(),
                {
                    "rid": msg.trace.rid,
                    "prompt_tokens": len(tokenized.input_ids) if tokenized else 0,
                    "constrained": msg.constraint is not None,
                    "refused": tokenized is None,
                },
            )
        return out
