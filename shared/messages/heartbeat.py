"""Liveness keys: every instance refreshes f"rs:live:{service}:{instance}" with a TTL."""

from __future__ import annotations

import msgspec


class ExecutorLoad(msgspec.Struct, kw_only=True, frozen=True):
    """What the scheduler routes by, refreshed with every executor heartbeat."""

    stream: str
    model: str
    context_length: int
    waiting: int
    running: int
    free_kv_tokens: int
    total_kv_tokens: int
    cached_tokens: int = 0
    evictable_tokens: int = 0
    max_running: int = 0


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True):
    service: str
    instance: str
    pid: int
    started: float
    ts: float
    executor: ExecutorLoad | None = None
