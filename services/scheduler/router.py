"""Admission and routing, synchronous: the service feeds it heartbeats and messages.

Load of an executor = its waiting + running requests from its last heartbeat, plus what this
scheduler sent it since that heartbeat (so a burst does not all land on one executor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from msgspec import Struct

from shared.hops import stamp
from shared.messages.common import ErrorInfo
from shared.messages.detok import RequestAborted, RequestFailed
from shared.messages.heartbeat import ExecutorLoad, Heartbeat
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import AbortRequest


@dataclass
class ExecutorView:
    instance: str
    load: ExecutorLoad
    beat_ts: float
    sent_since_beat: int = 0

    @property
    def queued(self) -> int:
        return self.load.waiting + self.sent_since_beat

    @property
    def busy(self) -> int:
        return self.load.waiting + self.load.running + self.sent_since_beat


@dataclass
class Assignment:
    executor: str
    detok_stream: str
    deadline: float


@dataclass
class Router:
    max_queued: int  # requests waiting in executors' queues, all executors together
    executors: dict[str, ExecutorView] = field(default_factory=dict)
    assigned: dict[str, Assignment] = field(default_factory=dict)  # rid -> where it went
    early_aborts: dict[str, float] = field(default_factory=dict)  # rid -> deadline
    # Until then (monotonic) an executor missing from the heartbeats is kept, not lost: after
    # a Redis restart every liveness key is gone until its owner's next beat.
    grace_until: float = 0.0

    def bus_restarted(self, grace_s: float, now: float | None = None) -> None:
        """Redis restarted empty: the requests routed before are gone (the gateways failed
        them and the executors end them), and executors get `grace_s` to beat again."""
        now = time.monotonic() if now is None else now
        self.assigned.clear()
        self.early_aborts.clear()
        self.grace_until = now + grace_s

    def update_executors(
        self, beats: list[Heartbeat], now: float | None = None
    ) -> list[tuple[str, Struct]]:
        """Take the live executors' heartbeats; fail the requests of executors that vanished."""
        now = time.monotonic() if now is None else now
        live: dict[str, ExecutorView] = {}
        for hb in beats:
            if hb.executor is None:
                continue
            old = self.executors.get(hb.instance)
            sent = old.sent_since_beat if old is not None and old.beat_ts == hb.ts else 0
            live[hb.instance] = ExecutorView(hb.instance, hb.executor, hb.ts, sent)
        lost = set(self.executors) - set(live)
        if lost and now < self.grace_until:
            live.update({name: self.executors[name] for name in lost})
            lost = set()
        self.executors = live
        out: list[tuple[str, Struct]] = []
        if lost:
            for rid, a in list(self.assigned.items()):
                if a.executor in lost:
                    del self.assigned[rid]
                    err = ErrorInfo(
                        status=503,
                        message=f"executor {a.executor} stopped responding; please retry",
                        type="server_error",
                    )
                    out.append((a.detok_stream, RequestFailed(rid=rid, error=err)))
        return out

    def route(self, req: TokenizedRequest, now: float | None = None) -> list[tuple[str, Struct]]:
        rid = req.trace.rid
        now = time.time() if now is None else now
        if rid in self.assigned:
            return []  # redelivered: already sent
        if self.early_aborts.pop(rid, None) is not None:
            return [(req.detok_stream, RequestAborted(rid=rid))]
        if req.trace.deadline < now:
            err = ErrorInfo(status=504, message="the request's deadline passed", type="timeout")
            return [(req.detok_stream, RequestFailed(rid=rid, error=err))]
        if not self.executors:
            err = ErrorInfo(
                status=503,
                message="no executor is alive to serve this request",
                type="server_error",
            )
            return [(req.detok_stream, RequestFailed(rid=rid, error=err))]
        queued = sum(e.queued for e in self.executors.values())
        if queued >= self.max_queued:
            err = ErrorInfo(
                status=503,
                message=f"the server's queue is full ({queued} requests waiting); retry later",
                type="server_error",
            )
            return [(req.detok_stream, RequestFailed(rid=rid, error=err))]
        fits = [e for e in self.executors.values() if len(req.input_ids) < e.load.context_length]
        if not fits:
            err = ErrorInfo(
                status=400, message="no executor has a context long enough", param="prompt"
            )
            return [(req.detok_stream, RequestFailed(rid=rid, error=err))]
        best = min(fits, key=lambda e: (e.busy, e.instance))
        best.sent_since_beat += 1
        self.assigned[rid] = Assignment(best.instance, req.detok_stream, req.trace.deadline)
        routed = msgspec.structs.replace(req, trace=stamp(req.trace, routed=time.time()))
        return [(best.load.stream, routed)]

    def broadcast(self, msg: Struct) -> list[tuple[str, Struct]]:
        """The same message to every live executor (cache flushes)."""
        return [(view.load.stream, msg) for view in self.executors.values()]

    def abort(self, msg: AbortRequest, now: float | None = None) -> list[tuple[str, Struct]]:
        a = self.assigned.get(msg.rid)
        if a is None:
            # Not here yet (being tokenized or compiled): end it when it arrives.
            now = time.time() if now is None else now
            self.early_aborts[msg.rid] = now + 600.0
            return []
        view = self.executors.get(a.executor)
        return [(view.load.stream, msg)] if view is not None else []

    def expire(self, now: float | None = None) -> None:
        """Forget requests past their deadline (the executor drops them by itself)."""
        now = time.time() if now is None else now
        for rid, a in list(self.assigned.items()):
            if a.deadline < now:
                del self.assigned[rid]
        for rid, until in list(self.early_aborts.items()):
            if until < now:
                del self.early_aborts[rid]
