"""Rates over recent samples of running totals: the generation throughput and the prefix
cache's hit rate, which the Prometheus scrape (metrics.py) and the heartbeat (main.py's
executor_load, for SGLang's /get_server_info) each take over their own samples: between two
samples at least MIN_SPAN_S apart, the newest and the oldest within RATE_WINDOW_S."""

from __future__ import annotations

from collections import deque

RATE_WINDOW_S = 30.0
MIN_SPAN_S = 1.0


class Window:
    """(time, generated, prompt, cached) totals at recent scrapes, for rates over them."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int, int]] = deque()
        self.throughput = 0.0
        self.hit_rate = 0.0

    def add(self, now: float, generated: int, prompt: int, cached: int) -> None:
        self.samples.append((now, generated, prompt, cached))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.popleft()
        t0, g0, p0, c0 = self.samples[0]
        if now - t0 >= MIN_SPAN_S:
            self.throughput = (generated - g0) / (now - t0)
            if prompt > p0:  # no request finished in the window: keep the last rate
                self.hit_rate = (cached - c0) / (prompt - p0)
