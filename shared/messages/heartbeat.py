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
    grammar_requests: int = 0  # constrained requests since start
    grammar_cache_hits: int = 0  # compiled grammars found in this executor's memory
    grammar_fetched: int = 0  # compiled grammars loaded from Redis
    grammar_load_s: float = 0.0  # time spent loading (or compiling) grammars
    jump_forward_tokens: int = 0  # tokens appended without a forward pass each


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True):
    service: str
    instance: str
    pid: int
    started: float
    ts: float
    executor: ExecutorLoad | None = None
