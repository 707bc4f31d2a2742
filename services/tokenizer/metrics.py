"""The tokenizer's metrics: calls by kind and how long each took (in its thread pool)."""

from __future__ import annotations

import time

from services.tokenizer.core import Tokenization
from services.tokenizer.handlers import Out, handle
from shared.messages.tokenize import AbortRequest, GenerateRequest, TokenizeMessage, TokenizeRequest
from shared.metrics.buckets import SERVICE_SECONDS
from shared.metrics.registry import ServiceMetrics


def kind_of(msg: TokenizeMessage) -> str:
    if isinstance(msg, GenerateRequest):
        return "generate"
    if isinstance(msg, TokenizeRequest):
        return "tokenize"
    return "abort" if isinstance(msg, AbortRequest) else "detokenize"


class TokenizerMetrics:
    def __init__(self, m: ServiceMetrics) -> None:
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
        started = time.perf_counter()
        out = handle(tok, msg, partitions)
        self.seconds.observe(time.perf_counter() - started)
        self.requests.labels(kind_of(msg)).inc()
        return out
