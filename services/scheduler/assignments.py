"""Where each request in flight went, with a running count per executor.

The count is the load the routing policies compare: every request the scheduler routed to an
executor and no detokenizer has called done yet (or that a lost executor handed back). Kept
beside the table, not recounted, because routing a burst of thousands would otherwise walk
the whole table once per request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass
class Assignment:
    executor: str
    detok_stream: str
    deadline: float
    reply_to: str = ""  # its gateway's reply stream


class Assignments(Mapping[str, Assignment]):
    """rid -> Assignment, read like a dict; changed only through these methods."""

    def __init__(self) -> None:
        self._by_rid: dict[str, Assignment] = {}
        self._per_executor: Counter[str] = Counter()

    def __getitem__(self, rid: str) -> Assignment:
        return self._by_rid[rid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_rid)

    def __len__(self) -> int:
        return len(self._by_rid)

    def held_by(self, executor: str) -> int:
        """Requests in flight on `executor`."""
        return self._per_executor[executor]

    def executors(self) -> set[str]:
        """The executors holding a request in flight."""
        return set(self._per_executor)

    def setdefault(self, rid: str, a: Assignment) -> Assignment:
        if rid not in self._by_rid:
            self._by_rid[rid] = a
            self._per_executor[a.executor] += 1
        return self._by_rid[rid]

    def pop(self, rid: str) -> Assignment | None:
        a = self._by_rid.pop(rid, None)
        if a is not None:
            self._per_executor[a.executor] -= 1
            if not self._per_executor[a.executor]:
                del self._per_executor[a.executor]
        return a

    def clear(self) -> None:
        self._by_rid.clear()
        self._per_executor.clear()
