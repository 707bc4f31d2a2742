"""The radix tree prefix cache (RadixAttention): token runs -> KV slots, shared by requests.

Slots are kept as python lists of ints: the tree is bookkeeping on the CPU, lists are cheaper
to slice and concatenate than small tensors, and the pool hands out lists. Page size N caches
and matches whole pages only: keys are cut to a multiple of N and nodes split on page borders.

Costs: match and insert walk the path (a dict lookup per node, slice compares per token run);
evict(n) pops a heap of leaves by last access, O(k log n) for k nodes evicted. The heap is
lazy: entries of nodes that gained a child or a lock are dropped when popped, and an entry
older than its node's last access is pushed again with the new time.
"""

from __future__ import annotations

import heapq
import itertools

from services.executor.cache.base import InsertResult, MatchResult, TreeNode, check_pool
from services.executor.kv_pool import KVPool

_CHUNK = 64  # tokens compared per slice before comparing one by one


def _common_len(node_key: list[int], key: list[int], start: int, end: int) -> int:
    """Length of the common prefix of node_key and key[start:end]."""
    n = min(len(node_key), end - start)
    if n == len(node_key) and node_key == key[start : start + n]:
        return n
    i = 0
    while i + _CHUNK <= n and node_key[i : i + _CHUNK] == key[start + i : start + i + _CHUNK]:
        i += _CHUNK
    while i < n and node_key[i] == key[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, pool: KVPool, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self.root = TreeNode([], [], None, 0, 0)
        self._clock = 0
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, seq, leaf)
        self._seq = itertools.count()  # heap tie-break: nodes are never compared
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._protected = 0  # tokens in nodes with lock_ref > 0
        self.evicted_tokens = 0  # freed by evict() since start (metrics)

    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookups -----------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The tree's slots for the longest cached prefix of key (whole pages), and the node
        ending there. If the match ends inside a node, that node is SPLIT so that the returned
        node ends exactly at the match. Marks the path as used now (LRU).

        The node is not locked: lock it before anything can evict (before the next `evict`).
        """
        end = len(key) - len(key) % self.page_size
        tick = self._tick()
        node, pos = self.root, 0
        slots: list[int] = []
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = _common_len(child.key, key, pos, end)
            m -= m % self.page_size  # >= 1 page: the first page is the dict key
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            slots += child.slots
            node, pos = child, pos + m
        return MatchResult(slots, node)

    def insert(self, key: list[int], slots: list[int]) -> InsertResult:
        """Cache `key` (cut to whole pages) whose KV lives in `slots`, one slot per token.

        Returns (cached_len, node): key[:cached_len] was cached already, the tree took
        slots[cached_len:tree_len], node ends at tree_len. The caller frees its duplicates
        slots[locked_len:cached_len] and keeps slots[tree_len:]: see cache/base.py for the
        exact rule. May split nodes; marks the path as used now.
        """
        if len(slots) != len(key):
            raise ValueError(f"insert needs one slot per token: {len(key)} tokens, {len(slots)}")
        end = len(key) - len(key) % self.page_size
        tick = self._tick()
        node, pos = self.root, 0
        while pos < end:
            ck = self._child_key(key, pos)
            child = node.children.get(ck)
            if child is None:
                leaf = TreeNode(key[pos:end], slots[pos:end], node, end, tick)
                node.children[ck] = leaf
                self._evictable += end - pos
                self._push(leaf)
                return InsertResult(pos, leaf)
            m = _common_len(child.key, key, pos, end)
            m -= m % self.page_size
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            node, pos = child, pos + m
        return InsertResult(end, node)

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Cut node after m tokens: a new node takes key[:m] and becomes its parent. `node`
        keeps key[m:] and its identity, so handles to it stay valid."""
        parent = node.parent
        assert parent is not None and 0 < m < len(node.key)
        upper = TreeNode(node.key[:m], node.slots[:m], parent, parent.depth + m, node.last_access)
        upper.lock_ref = node.lock_ref  # the same locks pass through both halves
        node.key, node.slots = node.key[m:], node.slots[m:]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        parent.children[self._child_key(upper.key, 0)] = upper  # same first page as before
        return upper

    # -- locks -------------------------------------------------------------------------------
    def _check_live(self, node: TreeNode) -> None:
        if node.parent is None and node is not self.root:
            raise ValueError(f"{node!r} is not in this tree (evicted, reset, or foreign)")

    def lock(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction; the root is a no-op handle."""
        self._check_live(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        self._check_live(node)
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    # -- eviction ----------------------------------------------------------------------------
    def _push(self, node: TreeNode) -> None:
        if not node.in_heap:
            node.in_heap = True
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until num_tokens are freed or
        nothing unlocked is left; a parent left childless is a leaf and a candidate in turn.
        Whole nodes go, so it may free more than asked. Returns the tokens freed."""
        freed = 0
        heap = self._heap
        while freed < num_tokens and heap:
            tick, _, node = heapq.heappop(heap)
            node.in_heap = False
            parent = node.parent
            if parent is None or node.children or node.lock_ref:
                continue  # gone, or not an evictable leaf now: pushed again when it becomes one
            if tick < node.last_access:
                self._push(node)  # used since it was pushed: requeue at its real time
                continue
            self.pool.free(node.slots)
            freed += len(node.slots)
            self._evictable -= len(node.slots)
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        self.evicted_tokens += freed
        return freed

    def reset(self) -> None:
        """Drop everything, every slot back to the pool. Nothing may be locked."""
        if self._protected:
            raise RuntimeError(f"reset of a radix cache with {self._protected} locked tokens")
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self.pool.free(node.slots)
            node.parent = None
            stack.extend(node.children.values())
        self.root.children = {}
        self._heap = []
        self._evictable = 0

    # -- sizes and checks --------------------------------------------------------------------
    def total_size(self) -> int:
        return self._evictable + self._protected

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def check_integrity(self, in_use: int) -> None:
        """Raise AssertionError unless: free + cached + in_use == pool size (in_use: slots held
        by requests outside the tree), tree slots distinct and not free, every node's
        lock_ref >= the sum of its children's (the rest are locks on the node itself), parents
        used no earlier than children, the size counters match a recount, and every unlocked
        leaf is in the eviction heap. O(cached tokens): for tests and debugging."""
        p = self.page_size
        cached: set[int] = set()
        num_cached = evictable = protected = in_heap = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                if child.parent is not node or ck != self._child_key(child.key, 0):
                    raise AssertionError(f"bad link from {node!r} to {child!r}")
                if child.last_access > node.last_access and node is not self.root:
                    raise AssertionError(f"{child!r} used after its parent {node!r}")
                stack.append(child)
            if node is self.root:
                continue
            n = len(node.key)
            assert node.parent is not None
            if n == 0 or n % p or len(node.slots) != n:
                raise AssertionError(f"bad node size ({n} tokens, page {p}): {node!r}")
            if node.depth != node.parent.depth + n:
                raise AssertionError(f"bad depth {node.depth}: {node!r}")
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                raise AssertionError(f"lock_ref below its children's: {node!r}")
            if node.lock_ref:
                protected += n
            else:
                evictable += n
                if not node.children and not node.in_heap:
                    raise AssertionError(f"unlocked leaf missing from the heap: {node!r}")
            in_heap += node.in_heap
            cached.update(node.slots)
            num_cached += n
        if self.root.lock_ref or self.root.slots:
            raise AssertionError("the root holds slots or locks")
        if (evictable, protected) != (self._evictable, self._protected):
            raise AssertionError(
                f"counters evictable {self._evictable} protected {self._protected}, "
                f"recount {evictable} {protected}"
            )
        if in_heap != len(self._heap):
            raise AssertionError(f"{len(self._heap)} heap entries for {in_heap} nodes")
        if any(t > node.last_access for t, _, node in self._heap):
            raise AssertionError("a heap entry is newer than its node's last use")
        check_pool(self.pool, cached, num_cached, in_use)

    def pretty_print(self) -> str:
        """The tree, one node per line, children indented: key, slots, lock_ref, last use."""
        lines: list[str] = []
        stack = [(c, 0) for c in reversed(self.root.children.values())]
        while stack:
            node, indent = stack.pop()
            lines.append(
                f"{'  ' * indent}{node.key} slots={node.slots} "
                f"lock={node.lock_ref} t={node.last_access}"
            )
            stack += [(c, indent + 1) for c in reversed(node.children.values())]
        return "\n".join(lines)
