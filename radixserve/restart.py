"""When to restart a dead child: exponential backoff and a restart limit (pure, no clock).

A child that ran for `healthy_s` before dying starts again from the shortest delay; one that
keeps dying waits twice as long each time, up to `max_delay_s`. More than `max_restarts`
restarts within `window_s` means restarting does not help (a broken GPU, a full disk): the
supervisor gives up rather than loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    healthy_s: float = 60.0  # uptime after which the backoff starts over
    max_restarts: int = 5
    window_s: float = 300.0


@dataclass(frozen=True)
class Restart:
    delay_s: float  # wait this long, then start it again


@dataclass(frozen=True)
class GiveUp:
    reason: str


class RestartTracker:
    """One child's restart history under a policy; times are any monotonic clock's seconds."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.failures = 0  # deaths in a row without a healthy run between them
        self.restarts: deque[float] = deque()  # when each restart was decided, oldest first

    def on_exit(self, now: float, started_at: float) -> Restart | GiveUp:
        p = self.policy
        if now - started_at >= p.healthy_s:
            self.failures = 0
        while self.restarts and now - self.restarts[0] > p.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= p.max_restarts:
            return GiveUp(f"{len(self.restarts)} restarts within {p.window_s:g}s")
        self.failures += 1
        self.restarts.append(now)
        delay = p.initial_delay_s * 2 ** (self.failures - 1)
        return Restart(min(delay, p.max_delay_s))
