"""The grammar service's cache policy, synchronous and without I/O: after the store missed a
key, what this instance does about it.

- a compile of the key is in flight here: share it (`Share`), do not start another;
- this instance compiled it lately (`Recent`): use that entry and store it again (the store
  lost it: it expired, or Redis restarted, and executors load grammars from the store);
- otherwise `Compile`, between `started` and `finished` (or `abandoned`).

The recent entries are an LRU of `recent` keys. A request whose store read went out before a
concurrent compile of its key stored the entry, and came back after that compile finished,
finds the entry here instead of compiling it a second time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.messages.grammar import GrammarCacheEntry

RECENT_ENTRIES = 256


@dataclass(frozen=True)
class Share:
    """Wait for the compile of this key already in flight."""


@dataclass(frozen=True)
class Recent:
    entry: GrammarCacheEntry


@dataclass(frozen=True)
class Compile:
    """Compile it: call `started`, then `finished` or `abandoned`."""


Decision = Share | Recent | Compile


class CompileBook:
    def __init__(self, recent: int = RECENT_ENTRIES) -> None:
        self.capacity = recent
        self.in_flight: set[str] = set()
        self.recent: OrderedDict[str, GrammarCacheEntry] = OrderedDict()

    def lookup(self, key: str) -> Decision:
        if key in self.in_flight:
            return Share()
        entry = self.recent.get(key)
        if entry is not None:
            self.recent.move_to_end(key)
            return Recent(entry)
        return Compile()

    def started(self, key: str) -> None:
        assert key not in self.in_flight, f"grammar {key} is compiling already"
        self.in_flight.add(key)

    def finished(self, key: str, entry: GrammarCacheEntry) -> None:
        self.in_flight.discard(key)
        self.recent[key] = entry
        self.recent.move_to_end(key)
        while len(self.recent) > self.capacity:
            self.recent.popitem(last=False)

    def abandoned(self, key: str) -> None:
        """The compile failed (not a refusal: an error); nothing is remembered."""
        self.in_flight.discard(key)
