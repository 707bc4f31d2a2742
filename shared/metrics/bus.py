"""What every service measures of the bus: how long the entries it reads waited in their
stream (from the entry id, which is Redis's clock at XADD in milliseconds), and the length
and backlog of the streams it reads (read from Redis at scrape time).

Entry ages compare Redis's clock with this host's, so across hosts they are only as exact
as clock synchronisation (the same caveat as the hop stamps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.metrics.buckets import SERVICE_SECONDS
from shared.metrics.registry import ServiceMetrics


@dataclass(frozen=True)
class WatchedStream:
    label: str  # the stream's kind (tokenize, executor, reply, ...), not its per-instance name
    key: str
    group: str | None = None  # the consumer group this service reads it through


class BusMetrics:
    def __init__(self, metrics: ServiceMetrics, r: aioredis.Redis) -> None:
        self.r = r
        self._wait = metrics.histogram(
            "radixserve:bus_wait_seconds",
            "Time entries waited in a Redis stream before this service read them",
            SERVICE_SECONDS,
            ["stream"],
        )
        self._length = metrics.gauge(
            "radixserve:stream_length", "Entries in a stream this service reads", ["stream"]
        )
        self._pending = metrics.gauge(
            "radixserve:stream_pending",
            "Entries of a stream not yet acknowledged (consumer groups) or not yet read",
            ["stream"],
        )
        self.watched: list[WatchedStream] = []
        if metrics.enabled:
            metrics.refreshers.append(self.refresh)

    def watch(self, label: str, key: str, group: str | None = None) -> None:
        stream = WatchedStream(label, key, group)
        if stream not in self.watched:  # a detokenizer partition may be taken again
            self.watched.append(stream)

    def observer(self, label: str) -> Callable[[Sequence[bytes]], None]:
        """A reader's `on_entries` callback recording the entries' wait under `label`."""
        wait = self._wait.labels(label)

        def observe(ids: Sequence[bytes]) -> None:
            now_ms = time.time() * 1000.0
            for entry_id in ids:
                wait.observe(max(0.0, now_ms - int(entry_id.split(b"-", 1)[0])) / 1000.0)

        return observe

    async def refresh(self) -> None:
        if not self.watched:
            return
        pipe = self.r.pipeline(transaction=False)
        for w in self.watched:
            pipe.xlen(w.key)
            if w.group is not None:
                pipe.xinfo_groups(w.key)
        results = iter(await pipe.execute(raise_on_error=False))
        for w in self.watched:
            length = next(results)
            self._length.labels(w.label).set(length if isinstance(length, int) else 0)
            if w.group is None:
                continue
            groups = next(results)
            if isinstance(groups, ResponseError | Exception):
                continue  # the stream does not exist yet
            pending = next((g for g in groups if _name(g) == w.group), None)
            if pending is not None:
                # lag: entries never delivered (Redis >= 7); pending: delivered, unacked
                lag = pending.get("lag") or 0
                self._pending.labels(w.label).set(int(pending.get("pending", 0)) + int(lag))


def _name(group: dict[str, object]) -> str:
    name = group.get("name", b"")
    return name.decode() if isinstance(name, bytes) else str(name)
