"""What the engine sees of a prefix cache, and who owns which KV slot.

Every slot is owned by exactly one of: the pool's free list, the cache, a running request.
The engine runs the same code with `RadixCache` and with `NullCache` (`--disable-radix-cache`):

    admit:   m = cache.match_prefix(prompt[:-1])      # keep >= 1 token to compute logits from
             cache.lock(m.node)                         # the tree's m.slots now outlive evictions
             locked_len = len(m.slots)
             slots = m.slots + pool.allocate(len(prompt) - locked_len)
    finish:  r = cache.insert(key, slots[: len(key)])  # key: the tokens whose KV is in slots
             pool.free(slots[locked_len : r.cached_len])  # duplicates of what the tree had
             pool.free(slots[r.tree_len :])               # what the tree did not take
             cache.unlock(m.node)

Exact rule for `insert(key, slots)`, with `locked_len` the length of the prefix the caller got
from the cache and still holds locked (0 if it holds nothing), and
`locked_len <= r.cached_len <= r.tree_len <= len(key)`:
  slots[:locked_len]                 the tree's own slots; the caller never frees them.
  slots[locked_len:r.cached_len]     duplicates: the tree already held these tokens (another
                                     request inserted them meanwhile). Still the caller's: it
                                     must free them and read the tree's copies instead.
  slots[r.cached_len:r.tree_len]     taken by the tree. The caller never frees them; it may
                                     read them while it holds a lock on `r.node`.
  slots[r.tree_len:]                 still the caller's: the tail short of a whole page, and
                                     everything when the cache is a NullCache (tree_len == 0).

A request that keeps running after an insert (chunked prefill) switches to the tree's copies:
    m2 = cache.match_prefix(key)      # len(m2.slots) == r.tree_len, m2.node is r.node
    slots[: len(m2.slots)] = m2.slots
    cache.lock(m2.node); cache.unlock(m.node); locked_len = len(m2.slots)
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from services.executor.kv_pool import KVPool


class TreeNode:
    """A run of tokens and their slots; also the handle that `lock`/`unlock` take.

    A split keeps the original object as the lower part, so a handle always ends at the same
    position (`depth`) for as long as it is in the tree.
    """

    __slots__ = (
        "children",
        "depth",
        "in_heap",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "slots",
    )

    def __init__(
        self,
        key: list[int],
        slots: list[int],
        parent: TreeNode | None,
        depth: int,
        last_access: int,
    ) -> None:
        # first token (page_size 1) or first page as a tuple -> child
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent  # None for the root and for nodes that left the tree
        self.key = key
        self.slots = slots  # slots[i] holds the KV of key[i]
        self.depth = depth  # tokens from the root to the end of this node
        self.lock_ref = 0  # locks held on this node or any descendant
        self.last_access = last_access  # the cache's logical clock, not wall time
        self.in_heap = False  # whether the eviction heap holds an entry for this node

    def __repr__(self) -> str:
        return f"TreeNode(key={self.key}, slots={self.slots}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    slots: list[int]  # the tree's slots of the longest cached prefix (a fresh list)
    node: TreeNode  # ends exactly there (the root when nothing matched): lock it


class InsertResult(NamedTuple):
    cached_len: int  # key[:cached_len] was in the tree before this call
    node: TreeNode  # ends at tree_len: lock it to keep the inserted sequence

    @property
    def tree_len(self) -> int:
        """key[:tree_len] is in the tree now: len(key) rounded down to whole pages, or 0 for a
        NullCache."""
        return self.node.depth


class PrefixCache(Protocol):
    page_size: int
    root: TreeNode  # the handle of the empty prefix: lock/unlock of it do nothing
    evicted_tokens: int  # freed by evict() since start (metrics)

    def match_prefix(self, key: list[int]) -> MatchResult: ...
    def insert(self, key: list[int], slots: list[int]) -> InsertResult: ...
    def lock(self, node: TreeNode) -> None: ...
    def unlock(self, node: TreeNode) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def reset(self) -> None: ...
    def total_size(self) -> int: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def check_integrity(self, in_use: int) -> None: ...
    def pretty_print(self) -> str: ...


def check_pool(pool: KVPool, cached: set[int], num_cached: int, in_use: int) -> None:
    """free + cached + in_use == total, nothing freed twice, no cached slot free."""
    free = pool.free_slots()
    free_set = set(free)
    if len(free_set) != len(free):
        raise AssertionError(f"{len(free) - len(free_set)} slots are in the free list twice")
    if any(not 0 <= s < pool.num_slots for s in free):
        raise AssertionError("a free slot is outside the pool")
    if len(cached) != num_cached:
        raise AssertionError(f"{num_cached - len(cached)} slots are held by two tree nodes")
    if cached & free_set:
        raise AssertionError(f"cached slots are also free: {sorted(cached & free_set)[:10]}")
    if any(not 0 <= s < pool.num_slots for s in cached):
        raise AssertionError("a cached slot is outside the pool")
    if len(free) + num_cached + in_use != pool.num_slots:
        raise AssertionError(
            f"KV leak: free {len(free)} + cached {num_cached} + in use {in_use} "
            f"!= {pool.num_slots} slots"
        )
