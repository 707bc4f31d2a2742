"""Where a request's time to first token went, hop by hop, and medians over recent requests.

Each service stamps the request (or its first token) as it passes it on (HopTimes, see
shared/messages/common.py); the gateway adds when the first delta reached its reply listener
and when the request's handler took it to write to the client. A stage is the time between
two consecutive stamps, so the stages of one request add up to its time to first token
inside the server. Pure: no I/O, no awaits.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

from shared.messages.common import HopTimes

# (stage, from stamp, to stamp): consecutive stamps along the request path
STAGES: tuple[tuple[str, str, str], ...] = (
    ("tokenize", "gateway_received", "tokenized"),  # gateway -> tokenizer -> published
    ("schedule", "tokenized", "routed"),  # bus -> scheduler (and grammar) -> published
    ("to_executor", "routed", "executor_inbox"),  # bus -> executor's reader
    ("queue", "executor_inbox", "first_launched"),  # waiting for a step to take it
    ("first_step", "first_launched", "first_on_host"),  # that step's forward pass
    ("executor_publish", "first_on_host", "executor_published"),  # bookkeeping, outbox
    ("detokenize", "executor_published", "detok_published"),  # bus -> detokenizer
    ("to_gateway", "detok_published", "gateway_replied"),  # bus -> reply listener
    ("gateway_handler", "gateway_replied", "gateway_handled"),  # listener -> handler
)


class FirstToken(NamedTuple):
    """A request's HopTimes and the gateway's own two stamps (unix seconds)."""

    hops: HopTimes
    replied: float  # the reply listener read the first delta
    handled: float  # the request's handler took it, to render and write it


def stage_ms(t: FirstToken) -> dict[str, float]:
    """Milliseconds per stage, for stages whose two stamps were both recorded, plus `total`
    (gateway received -> handled) when both ends were."""
    stamps = {f: getattr(t.hops, f) for f in t.hops.__struct_fields__}
    stamps["gateway_replied"], stamps["gateway_handled"] = t.replied, t.handled
    out = {
        name: round((stamps[b] - stamps[a]) * 1000.0, 3)
        for name, a, b in STAGES
        if stamps[a] > 0.0 and stamps[b] > 0.0
    }
    if stamps["gateway_received"] > 0.0 and t.handled > 0.0:
        out["total"] = round((t.handled - stamps["gateway_received"]) * 1000.0, 3)
    return out


class HopStats:
    """Stage latencies of the last `window` requests; `summary()` gives their medians."""

    def __init__(self, window: int = 1000) -> None:
        self.window = window
        self.samples: dict[str, deque[float]] = {}  # stage -> recent latencies (ms)
        self.count = 0  # requests recorded since start

    def add(self, stages: dict[str, float]) -> None:
        self.count += 1
        for name, ms in stages.items():
            self.samples.setdefault(name, deque(maxlen=self.window)).append(ms)

    def summary(self) -> dict[str, object]:
        names = [s for s, _, _ in STAGES] + ["total"]
        return {
            "requests": self.count,
            "window": self.window,
            "median_ms": {
                n: round(statistics.median(self.samples[n]), 3) for n in names if n in self.samples
            },
        }
