"""Admission, routing and executor loss, synchronous: the service feeds it heartbeats and
messages, and stores the route changes it accumulates (`take_changes`) in Redis.

Which executor a request goes to is its policy's choice (policy.py, `--load-balance-method`),
among the executors alive, with a context long enough, and not lost by this request before.
Load of an executor = the requests this scheduler routed there that are not done yet, or what
its last heartbeat reported (waiting + running, plus what was sent since), whichever is more:
a heartbeat that left before the executor read what was sent to it cannot make a burst land
on one executor, and after a restart the heartbeat still counts what the table forgot.

An executor is lost when its liveness key is gone (it expired, or the supervisor deleted it on
seeing the process exit) or when its heartbeat has not changed for `stale_after_s`: routing to
it stops at once, and every request it held is handed to failover (see failover.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from msgspec import Struct

from services.scheduler import routes
from services.scheduler.assignments import Assignment, Assignments
from services.scheduler.policy import Policy
from shared import constants
from shared.hops import stamp
from shared.messages.common import AbortRequest, ErrorInfo
from shared.messages.detok import RequestAborted, RequestFailed
from shared.messages.heartbeat import ExecutorLoad, Heartbeat
from shared.messages.schedule import FlushCache, TokenizedRequest

# An executor whose heartbeat (every 0.5 s) has not changed for this long is lost.
STALE_AFTER_S = 2.0

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(TokenizedRequest)
UNKNOWN_CAPACITY = 1 << 62


@dataclass
class ExecutorView:
    """An executor as its last heartbeat showed it, plus what was sent to it since (which
    that heartbeat may or may not count yet: Router.loads takes the exact count as well)."""

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
class LostExecutor:
    """An executor that stopped serving, and the requests it held (no longer assigned)."""

    instance: str
    stream: str  # its input stream ("" if it was never seen beating by this scheduler)
    # Its liveness key still exists: it only stopped beating, and may yet be running.
    maybe_alive: bool
    requests: dict[str, Assignment] = field(default_factory=dict)


def _failure(status: int, message: str, retry: bool = False) -> ErrorInfo:
    return ErrorInfo(
        status=status,
        message=message,
        type="server_error" if status >= 500 else "invalid_request_error",
        retry_after=1 if retry else None,
    )


@dataclass
class RouterStats:
    """Totals since start, for the scheduler's metrics (read when they are scraped)."""

    routed: Counter[str] = field(default_factory=Counter)  # executor instance -> requests
    resumed: int = 0  # requests routed again after their executor was lost
    ended: Counter[str] = field(default_factory=Counter)  # refused here: status code -> count


@dataclass
class Router:
    max_queued: int  # requests waiting in executors' queues, all executors together
    stale_after_s: float = STALE_AFTER_S
    # A request resumed from a lost executor that finds no other waits this long for one (the
    # supervisor restarting the lost one) before it fails with a retryable 503.
    resume_wait_s: float = 60.0
    # The service passes --load-balance-method's (cache_aware by default); plain
    # least-loaded here, so tests of admission and failover do not depend on prefixes.
    policy: Policy = field(default_factory=Policy)
    executors: dict[str, ExecutorView] = field(default_factory=dict)
    assigned: Assignments = field(default_factory=Assignments)  # rid -> where it went
    early_aborts: dict[str, float] = field(default_factory=dict)  # rid -> deadline
    # Until then (monotonic) an executor missing from the heartbeats is kept, not lost: after
    # a Redis restart every liveness key is gone until its owner's next beat.
    grace_until: float = 0.0
    # instance -> (its last heartbeat's ts, monotonic time that ts was first seen)
    beat_seen: dict[str, tuple[float, float]] = field(default_factory=dict)
    # instance -> the ts of the beat it went silent on: not live again until it beats anew
    silent: dict[str, float] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=dict)  # instance -> its input stream
    gateways: set[str] = field(default_factory=set)  # reply streams of the live gateways
    # Route changes for Redis (routes.py): rid -> record to store, rids to forget.
    saves: dict[str, bytes] = field(default_factory=dict)
    deletes: set[str] = field(default_factory=set)
    # How to undo what this batch did to the table, should its commit fail: the routes it
    # made were never sent (their entries come again), the early aborts it used come back.
    undo: list[Callable[[], object]] = field(default_factory=list)
    staged_deletes: list[str] = field(default_factory=list)
    # rid -> (unix time it waits until, the resumed request waiting for an executor)
    parked: dict[str, tuple[float, TokenizedRequest]] = field(default_factory=dict)
    stats: RouterStats = field(default_factory=lambda: RouterStats())

    def take_changes(self) -> tuple[dict[str, bytes], list[str]]:
        """The batch's changes for Redis, committed with its messages; then `committed()`,
        or `commit_failed()` when that commit raised."""
        saves, deletes = self.saves, [rid for rid in self.deletes if rid not in self.saves]
        self.saves, self.deletes = {}, set()
        self.staged_deletes = deletes
        return saves, deletes

    def committed(self) -> None:
        self.undo.clear()
        self.staged_deletes = []

    def commit_failed(self) -> None:
        """The batch's messages never went out: forget its routes (so its entries, delivered
        again, are routed again) and keep its deletions for the next commit."""
        for action in reversed(self.undo):
            action()
        self.undo.clear()
        self.deletes.update(self.staged_deletes)
        self.staged_deletes = []

    def unlose(self, lost: list[LostExecutor]) -> None:
        """The resumption of these executors' requests could not be sent: they are theirs
        again, so the next look at the heartbeats finds them lost once more."""
        for ex in lost:
            for rid, a in ex.requests.items():
                self.assigned.setdefault(rid, a)

    def bus_restarted(self, grace_s: float, now: float | None = None) -> None:
        """Redis restarted empty: the requests routed before are gone (the gateways failed
        them and the executors end them), and executors get `grace_s` to beat again."""
        now = time.monotonic() if now is None else now
        self.assigned.clear()
        self.early_aborts.clear()
        self.saves.clear()
        self.deletes.clear()
        self.beat_seen.clear()
        self.silent.clear()
        self.grace_until = now + grace_s

    def restore(self, rid: str, record: routes.RouteRecord) -> None:
        """A route stored by an earlier leader (a new leader's table is rebuilt from them);
        its prompt is the policy's to learn again, as if routed now."""
        if rid in self.assigned:
            return
        self.assigned.setdefault(
            rid,
            Assignment(record.executor, record.detok_stream, record.deadline, record.reply_to),
        )
        try:
            req = _request_decoder.decode(record.request)
        except msgspec.DecodeError:
            return  # written by another version: routed by its resumption, if ever
        view = self.executors.get(record.executor)
        # An executor not seen beating yet: its tree is trimmed at its next route.
        capacity = view.load.total_kv_tokens if view is not None else UNKNOWN_CAPACITY
        self.policy.routed(record.executor, req.input_ids + req.resume_ids, capacity)

    def update_executors(
        self, beats: list[Heartbeat], now: float | None = None
    ) -> list[LostExecutor]:
        """Take the live executors' heartbeats; the executors lost since the last call, each
        with the requests it held (which are no longer assigned)."""
        now = time.monotonic() if now is None else now
        live: dict[str, ExecutorView] = {}
        keyed: set[str] = set()  # executors whose liveness key exists
        for hb in beats:
            if hb.executor is None:
                continue
            keyed.add(hb.instance)
            self.streams[hb.instance] = hb.executor.stream
            if self.silent.get(hb.instance) == hb.ts:
                continue  # lost on this very beat: live again only once it beats anew
            self.silent.pop(hb.instance, None)
            seen_ts, since = self.beat_seen.get(hb.instance, (hb.ts, now))
            if seen_ts != hb.ts:
                since = now
            self.beat_seen[hb.instance] = (hb.ts, since)
            if now - since > self.stale_after_s and now >= self.grace_until:
                self.silent[hb.instance] = hb.ts
                continue
            old = self.executors.get(hb.instance)
            sent = old.sent_since_beat if old is not None and old.beat_ts == hb.ts else 0
            live[hb.instance] = ExecutorView(hb.instance, hb.executor, hb.ts, sent)
        known = set(self.executors) | self.assigned.executors()
        lost_names = known - set(live)
        if lost_names and now < self.grace_until:
            live.update({n: self.executors[n] for n in lost_names if n in self.executors})
            lost_names -= set(self.executors)
        self.executors = live
        for name in set(self.beat_seen) - keyed:
            del self.beat_seen[name]  # its key is gone: a later beat starts afresh
        lost = {
            name: LostExecutor(name, self.streams.get(name, ""), name in keyed)
            for name in lost_names
        }
        if lost:
            for rid, a in list(self.assigned.items()):
                if a.executor in lost:
                    self.assigned.pop(rid)
                    lost[a.executor].requests[rid] = a
        for name in lost:
            self.policy.lost(name)
            if name not in keyed:
                self.streams.pop(name, None)
        return list(lost.values())

    def update_gateways(
        self, instances: list[str], now: float | None = None
    ) -> list[tuple[str, Struct]]:
        """Take the live gateways; abort the requests of a gateway that is gone (nobody is
        left to read their answers: their KV and compute go to the living)."""
        now = time.monotonic() if now is None else now
        live = {constants.reply_stream(i) for i in instances}
        if now < self.grace_until:  # after a Redis restart, liveness keys are coming back
            self.gateways |= live
            return []
        gone, self.gateways = self.gateways - live, live
        out: list[tuple[str, Struct]] = []
        for rid, a in self.assigned.items():
            view = self.executors.get(a.executor)
            if a.reply_to in gone and view is not None:
                out.append((view.load.stream, AbortRequest(rid=rid, reason="gateway lost")))
        return out

    def route(self, req: TokenizedRequest, now: float | None = None) -> list[tuple[str, Struct]]:
        rid = req.trace.rid
        now = time.time() if now is None else now
        if rid in self.assigned:
            return []  # redelivered: already sent
        until = self.early_aborts.pop(rid, None)
        if until is not None:
            self.undo.append(lambda: self.early_aborts.__setitem__(rid, until))
            return self._ended(req, RequestAborted(rid=rid))
        if req.trace.deadline < now:
            err = ErrorInfo(status=504, message="the request's deadline passed", type="timeout")
            return self._ended(req, RequestFailed(rid=rid, error=err))
        if req.resumes and not any(
            e.instance not in req.avoid and len(req.input_ids) < e.load.context_length
            for e in self.executors.values()
        ):
            return self._park(req, now)
        if not self.executors:
            err = _failure(503, "no executor is alive to serve this request", retry=True)
            return self._ended(req, RequestFailed(rid=rid, error=err))
        queued = sum(e.queued for e in self.executors.values())
        # A resumed request was admitted once already: it is not refused for the queue.
        if queued >= self.max_queued and not req.resumes:
            msg = f"the server's queue is full ({queued} requests waiting); retry later"
            return self._ended(req, RequestFailed(rid=rid, error=_failure(503, msg, True)))
        fits = [e for e in self.executors.values() if len(req.input_ids) < e.load.context_length]
        if not fits:
            err = ErrorInfo(
                status=400, message="no executor has a context long enough", param="prompt"
            )
            return self._ended(req, RequestFailed(rid=rid, error=err))
        fits = [e for e in fits if e.instance not in req.avoid]
        if not fits:
            msg = "no other executor is alive to resume this request on; retry"
            return self._ended(req, RequestFailed(rid=rid, error=_failure(503, msg, True)))
        # what the executor will prefill
        tokens = req.input_ids + req.resume_ids if req.resume_ids else req.input_ids
        best = self.executors[self.policy.choose(tokens, self.loads(fits))]
        # (a route undone by a failed commit stays in the policy's trees: they are a guess)
        self.policy.routed(best.instance, tokens, best.load.total_kv_tokens)
        best.sent_since_beat += 1
        self.stats.routed[best.instance] += 1
        self.stats.resumed += req.resumes > 0
        reply_to = req.trace.reply_to
        self.assigned.setdefault(
            rid, Assignment(best.instance, req.detok_stream, req.trace.deadline, reply_to)
        )
        self.undo.append(lambda: self.assigned.pop(rid))
        routed = msgspec.structs.replace(req, trace=stamp(req.trace, routed=time.time()))
        record = routes.RouteRecord(
            best.instance, req.detok_stream, req.trace.deadline, _encoder.encode(routed), reply_to
        )
        self.saves[rid] = routes.encode(record)
        return [(best.load.stream, routed)]

    def loads(self, views: list[ExecutorView]) -> dict[str, int]:
        """instance -> its load (see the module's docstring)."""
        return {e.instance: max(e.busy, self.assigned.held_by(e.instance)) for e in views}

    def _park(self, req: TokenizedRequest, now: float) -> list[tuple[str, Struct]]:
        """Hold a resumed request until an executor it may go to is alive."""
        rid = req.trace.rid
        if rid not in self.parked:
            self.parked[rid] = (min(req.trace.deadline, now + self.resume_wait_s), req)
        return []

    def unpark(self, now: float | None = None) -> list[tuple[str, Struct]]:
        """Route the parked requests that can go now; fail those that waited too long."""
        now = time.time() if now is None else now
        out: list[tuple[str, Struct]] = []
        for rid, (until, req) in list(self.parked.items()):
            can_go = any(
                e.instance not in req.avoid and len(req.input_ids) < e.load.context_length
                for e in self.executors.values()
            )
            if can_go:
                del self.parked[rid]
                out += self.route(req, now)
            elif now >= until:
                del self.parked[rid]
                msg = "no executor came back to resume this request on; retry"
                out += self._ended(req, RequestFailed(rid=rid, error=_failure(503, msg, True)))
        return out

    def _ended(self, req: TokenizedRequest, msg: Struct) -> list[tuple[str, Struct]]:
        self.stats.ended[str(msg.error.status) if isinstance(msg, RequestFailed) else "abort"] += 1
        if req.resumes:  # it was routed before: its stored route goes too
            self.deletes.add(req.trace.rid)
        return [(req.detok_stream, msg)]

    def done(self, rid: str) -> None:
        """A detokenizer sent the request's final answer: nothing is left to resume."""
        self.assigned.pop(rid)
        self.saves.pop(rid, None)
        self.deletes.add(rid)

    def broadcast(self, msg: Struct) -> list[tuple[str, Struct]]:
        """The same message to every live executor (cache flushes)."""
        return [(view.load.stream, msg) for view in self.executors.values()]

    def flush_cache(self, msg: FlushCache) -> list[tuple[str, Struct]]:
        """Every executor drops its cached prefixes: nothing is left to route by either."""
        self.policy.flushed()
        return self.broadcast(msg)

    def abort(self, msg: AbortRequest, now: float | None = None) -> list[tuple[str, Struct]]:
        a = self.assigned.get(msg.rid)
        if a is None:
            # Not here yet (being tokenized or compiled, or being resumed): end it when it
            # arrives.
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
                self.assigned.pop(rid)
                self.deletes.add(rid)
        for rid, until in list(self.early_aborts.items()):
            if until < now:
                del self.early_aborts[rid]
