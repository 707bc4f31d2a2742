"""Requests and heartbeats for the scheduler's tests."""

from __future__ import annotations

from collections.abc import Sequence

from shared.messages.common import SamplingParams, Trace
from shared.messages.heartbeat import ExecutorLoad, Heartbeat
from shared.messages.schedule import TokenizedRequest


def make_request(
    rid: str, n: int = 4, deadline: float = 1e12, ids: Sequence[int] | None = None
) -> TokenizedRequest:
    """A request of prompt `ids` (default: 0..n-1)."""
    return TokenizedRequest(
        trace=Trace(rid=rid, reply_to="rs:reply:g", deadline=deadline),
        input_ids=list(range(n)) if ids is None else list(ids),
        sampling=SamplingParams(),
        max_new_tokens=8,
        eos_token_ids=[0],
        detok_stream="rs:detok:0",
    )


def beat(
    name: str,
    waiting: int = 0,
    running: int = 0,
    ts: float = 1.0,
    context_length: int = 64,
    total_kv_tokens: int = 100,
) -> Heartbeat:
    load = ExecutorLoad(
        stream=f"rs:exec:{name}",
        model="m",
        context_length=context_length,
        waiting=waiting,
        running=running,
        free_kv_tokens=total_kv_tokens,
        total_kv_tokens=total_kv_tokens,
    )
    return Heartbeat(service="executor", instance=name, pid=1, started=0, ts=ts, executor=load)
