"""The detokenizer's metrics (time per batch of entries, requests open in the partitions this
instance owns, requests answered by how they finished) and its span of each request
(detokenize: from its registration to its last reply, under the gateway's span)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from msgspec import Struct

from services.detokenizer.core import RequestState
from services.detokenizer.partition import Partition
from shared.messages.reply import Delta, Failure
from shared.metrics.buckets import SERVICE_SECONDS
from shared.metrics.registry import ServiceMetrics
from shared.tracing import Tracing


class DetokMetrics:
    def __init__(self, m: ServiceMetrics, tracing: Tracing | None = None) -> None:
        self.tracing = tracing or Tracing("detokenizer", "")
        self.partitions: dict[int, Partition] = {}  # the partitions owned now
        self.finished: Counter[str] = Counter()  # finish reason ("error": failed) -> requests
        self.enabled = m.enabled
        self.seconds = m.histogram(
            "radixserve:detokenize_seconds",
            "Time to turn one batch of stream entries (every request's tokens of a step) "
            "into text deltas",
            SERVICE_SECONDS,
        )
        m.gauge_function(
            "radixserve:detokenizer_requests",
            "Requests open in the partitions this instance owns",
            lambda: sum(len(p.detok.states) for p in self.partitions.values()),
        )
        m.counter_function(
            "radixserve:detokenizer_finished_total",
            "Requests answered, by finish reason (stop, length, abort; error: failed)",
            lambda: {(reason,): n for reason, n in self.finished.items()},
            ["finish"],
        )

    def fed(self, out: list[tuple[str, Struct]], seconds: float, replaying: bool) -> None:
        """One batch handled in `seconds`; `out` is what it published."""
        self.seconds.observe(seconds)
        if replaying or not self.enabled:
            return  # a takeover's replay re-derives answers its predecessor counted
        for _, msg in out:
            reason: Any = None
            if isinstance(msg, Delta):
                reason = msg.finish_reason
            elif isinstance(msg, Failure):
                reason = "error"
            if reason is not None:
                self.finished[reason] += 1

    def ended(self, state: RequestState, finish: str) -> None:
        """A request's last reply is out (Detokenizer.on_finished): its span."""
        self.tracing.record(
            "detokenize",
            state.trace.traceparent,
            state.registered,
            time.time(),
            {
                "rid": state.trace.rid,
                "completion_tokens": state.completion_tokens,
                "finish_reason": finish,
            },
        )
