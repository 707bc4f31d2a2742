"""The cache that caches nothing (`--disable-radix-cache`), a drop-in for RadixCache.

It follows the ownership rule of cache/base.py with nothing in the tree: match returns no
slots and the root handle, insert takes no slots (cached_len == tree_len == 0, so the engine's
`free(slots[locked_len:cached_len])` frees nothing and `free(slots[tree_len:])` frees them
all), lock/unlock of the root do nothing, evict frees nothing.
"""

from __future__ import annotations

from services.executor.cache.base import InsertResult, MatchResult, TreeNode, check_pool
from services.executor.kv_pool import KVPool


class NullCache:
    def __init__(self, pool: KVPool, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self.root = TreeNode([], [], None, 0, 0)  # the only handle; never has children

    def _check_handle(self, node: TreeNode) -> None:
        if node is not self.root:
            raise ValueError(f"{node!r} did not come from this NullCache")

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult([], self.root)

    def insert(self, key: list[int], slots: list[int]) -> InsertResult:
        if len(slots) != len(key):
            raise ValueError(f"insert needs one slot per token: {len(key)} tokens, {len(slots)}")
        return InsertResult(0, self.root)

    def lock(self, node: TreeNode) -> None:
        self._check_handle(node)

    def unlock(self, node: TreeNode) -> None:
        self._check_handle(node)

    evicted_tokens = 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    def total_size(self) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def check_integrity(self, in_use: int) -> None:
        check_pool(self.pool, set(), 0, in_use)

    def pretty_print(self) -> str:
        return ""
