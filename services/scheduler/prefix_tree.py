"""The scheduler's guess of what each executor has cached: the token prefixes it routed there.

One trie over blocks of BLOCK tokens, shared by every executor (a prompt routed to two
executors is stored once), with each executor holding a set of its nodes in LRU order. The
scheduler sees no executor's real radix cache, so this is approximate: an executor may have
evicted what its tree still holds, and it holds prompts only, never outputs.

Why blocks and not tokens: a match walks one dict lookup per block, 128 for a 2,048-token
prompt instead of 2,048, on the scheduler's one thread that routes every request; and the
tree holds 16x fewer nodes. A match is then short by up to BLOCK - 1 tokens at its end, which
moves a match ratio by less than a cache threshold ever cares about. 16 is the block SMG's
cache-aware policy uses (its `--block-size` default, the FlashInfer page). The last, partial
block of a prompt is kept too, as a leaf: identical prompts (the `n` samples of one request)
then match in full, however short.

Invariants: an executor that holds a node holds all its ancestors; its LRU order always has
a node after every one of its descendants (a path is touched leaf first, root last), so its
least recently used node is a leaf and evicting it never orphans another.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

BLOCK = 16
ROOT = 0

Key = tuple[int, tuple[int, ...]]  # (parent node id, the node's tokens)


class PrefixTrees:
    def __init__(self, block: int = BLOCK) -> None:
        if block <= 0:
            raise ValueError(f"the block must be positive, got {block}")
        self.block = block
        self._children: dict[Key, int] = {}  # (parent, tokens) -> node id
        self._keys: dict[int, Key] = {}  # node id -> its key in _children
        self._holders: dict[int, int] = {}  # node id -> executors that hold it
        # executor -> node id -> its tokens, least recently used first
        self._lru: dict[str, OrderedDict[int, int]] = {}
        self._tokens: dict[str, int] = {}  # executor -> tokens it holds
        self._next_id = ROOT + 1

    def _chunks(self, tokens: Sequence[int]) -> Iterator[tuple[int, ...]]:
        for start in range(0, len(tokens), self.block):
            yield tuple(tokens[start : start + self.block])

    def _path(self, tokens: Sequence[int]) -> list[int]:
        """Node ids of the longest stored prefix of `tokens`, root side first."""
        path, parent = [], ROOT
        for chunk in self._chunks(tokens):
            node = self._children.get((parent, chunk))
            if node is None:
                break
            path.append(node)
            parent = node
        return path

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """executor -> how many leading tokens of `tokens` its tree holds (executors that
        hold none are left out)."""
        path = self._path(tokens)
        out: dict[str, int] = {}
        for executor, held in self._lru.items():
            matched = 0
            for node in path:  # held nodes form a prefix of the path (ancestors are held)
                size = held.get(node)
                if size is None:
                    break
                matched += size
            if matched:
                out[executor] = matched
        return out

    def insert(self, executor: str, tokens: Sequence[int], max_tokens: int) -> None:
        """`tokens` were routed to `executor`: its tree holds them, most recently used, then
        sheds its least recently used blocks until it holds at most `max_tokens`."""
        held = self._lru.setdefault(executor, OrderedDict())
        path: list[tuple[int, int]] = []  # (node, its size)
        parent = ROOT
        for chunk in self._chunks(tokens):
            node = self._children.get((parent, chunk))
            if node is None:
                node = self._next_id
                self._next_id += 1
                self._children[(parent, chunk)] = node
                self._keys[node] = (parent, chunk)
                self._holders[node] = 0
            path.append((node, len(chunk)))
            parent = node
        for node, size in reversed(path):  # leaf first: ancestors end up more recent
            if node in held:
                held.move_to_end(node)
            else:
                held[node] = size
                self._holders[node] += 1
                self._tokens[executor] = self._tokens.get(executor, 0) + size
        while self._tokens.get(executor, 0) > max_tokens:
            node, size = held.popitem(last=False)
            self._tokens[executor] -= size
            self._release(node)

    def drop(self, executor: str) -> None:
        """Forget everything routed to `executor` (it was lost, or flushed its cache)."""
        for node in self._lru.pop(executor, {}):
            self._release(node)
        self._tokens.pop(executor, None)

    def clear(self) -> None:
        for executor in list(self._lru):
            self.drop(executor)

    def tokens(self, executor: str) -> int:
        """Tokens `executor`'s tree holds."""
        return self._tokens.get(executor, 0)

    def executors(self) -> list[str]:
        return list(self._lru)

    def nodes(self) -> int:
        """Nodes of the shared trie (tests: nothing is left behind)."""
        return len(self._keys)

    def check(self) -> None:
        """Every invariant of the module's docstring, and the counts behind them (tests)."""
        holders: dict[int, int] = {}
        for executor, held in self._lru.items():
            assert sum(held.values()) == self._tokens.get(executor, 0), executor
            seen: set[int] = set()
            for node in held:  # least recent first: a parent comes after its children
                parent, chunk = self._keys[node]
                assert held[node] == len(chunk) and node not in seen
                assert parent == ROOT or (parent in held and parent not in seen), executor
                seen.add(node)
                holders[node] = holders.get(node, 0) + 1
        assert holders == self._holders
        assert set(self._keys) == set(holders)
        assert {v: k for k, v in self._children.items()} == self._keys

    def _release(self, node: int) -> None:
        self._holders[node] -= 1
        if self._holders[node] == 0:  # nobody holds it, nor (invariant) any descendant
            del self._holders[node]
            del self._children[self._keys.pop(node)]
