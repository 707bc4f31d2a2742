"""Exact tests of the radix cache: which slots come back, splits, eviction order, locks, pages,
and the request lifecycle of cache/base.py run with both RadixCache and NullCache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from services.executor.cache import NullCache, PrefixCache, RadixCache, TreeNode
from services.executor.kv_pool import KVPool


class LoggedPool(KVPool):
    """A KVPool without K/V buffers that records every free() call."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, 0, 1, 1, torch.float32, "cpu")
        self.freed: list[list[int]] = []

    def free(self, slots: list[int]) -> None:
        self.freed.append(list(slots))
        super().free(slots)


def make_cache(num_slots: int = 32, page_size: int = 1) -> tuple[RadixCache, LoggedPool]:
    pool = LoggedPool(num_slots)
    return RadixCache(pool, page_size), pool


def insert_new(cache: RadixCache, pool: KVPool, key: list[int]) -> list[int]:
    """Insert key with fresh slots, free the duplicates; return the slots the tree took."""
    slots = pool.allocate(len(key))
    r = cache.insert(key, slots)
    pool.free(slots[: r.cached_len] + slots[r.tree_len :])
    return slots[r.cached_len : r.tree_len]


# -- match, insert, splits -------------------------------------------------------------------


def test_empty_tree_matches_nothing() -> None:
    cache, _ = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.slots == [] and m.node is cache.root and m.node.depth == 0
    cache.check_integrity(in_use=0)


def test_match_ending_inside_a_node_splits_it() -> None:
    cache, pool = make_cache()
    slots = pool.allocate(5)
    assert slots == [0, 1, 2, 3, 4]
    r = cache.insert([1, 2, 3, 4, 5], slots)
    assert (r.cached_len, r.tree_len) == (0, 5)
    leaf = r.node

    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots == [0, 1, 2]
    assert (m.node.key, m.node.slots, m.node.depth) == ([1, 2, 3], [0, 1, 2], 3)
    assert m.node.parent is cache.root and list(cache.root.children.values()) == [m.node]
    # the original node is the lower half: a handle to it still ends at token 5
    assert list(m.node.children.values()) == [leaf]
    assert (leaf.key, leaf.slots, leaf.depth, leaf.parent) == ([4, 5], [3, 4], 5, m.node)
    assert (
        cache.pretty_print()
        == "[1, 2, 3] slots=[0, 1, 2] lock=0 t=2\n  [4, 5] slots=[3, 4] lock=0 t=1"
    )
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots == [0, 1, 2, 3, 4]
    assert cache.match_prefix([2, 1]).slots == []
    cache.check_integrity(in_use=0)


def test_match_of_a_key_shorter_than_the_node_splits_at_its_end() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2])
    assert m.slots == [0, 1] and m.node.key == [1, 2] and m.node.depth == 2
    assert [c.key for c in m.node.children.values()] == [[3, 4, 5]]
    cache.check_integrity(in_use=0)


def test_insert_returns_what_was_cached_and_takes_only_the_rest() -> None:
    cache, pool = make_cache()
    a = pool.allocate(5)  # [0..4]
    cache.insert([1, 2, 3, 4, 5], a)
    b = pool.allocate(5)  # [5..9]: computed concurrently, sharing [1, 2, 3]
    r = cache.insert([1, 2, 3, 6, 7], b)
    assert (r.cached_len, r.tree_len) == (3, 5)
    assert (r.node.key, r.node.slots) == ([6, 7], [8, 9])
    cache.check_integrity(in_use=3)  # b[:3] are still the caller's
    pool.free(b[: r.cached_len])
    cache.check_integrity(in_use=0)
    shared = cache.match_prefix([1, 2, 3]).node
    assert (shared.key, shared.slots) == ([1, 2, 3], [0, 1, 2])
    assert [(c.key, c.slots) for c in shared.children.values()] == [
        ([4, 5], [3, 4]),
        ([6, 7], [8, 9]),
    ]
    assert cache.match_prefix([1, 2, 3, 6, 7, 8]).slots == [0, 1, 2, 8, 9]
    assert cache.total_size() == 7


def test_insert_of_a_cached_prefix_takes_nothing_and_returns_a_node_ending_there() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 2, 3, 4, 5])
    dup = pool.allocate(3)
    r = cache.insert([1, 2, 3], dup)
    assert (r.cached_len, r.tree_len) == (3, 3)
    assert (r.node.key, r.node.slots) == ([1, 2, 3], [0, 1, 2])
    pool.free(dup)
    cache.check_integrity(in_use=0)


def test_insert_needs_one_slot_per_token() -> None:
    cache, _ = make_cache()
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert([1, 2, 3], [0, 1])


# -- eviction --------------------------------------------------------------------------------


def test_evict_takes_least_recently_used_leaves_first() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 1])  # slots [0, 1]
    insert_new(cache, pool, [2, 2])  # [2, 3]
    insert_new(cache, pool, [3, 3])  # [4, 5]
    cache.match_prefix([1, 1, 7])  # [1, 1] is now the most recently used
    pool.freed.clear()
    assert cache.evict(1) == 2  # whole nodes: may free more than asked
    assert pool.freed == [[2, 3]]
    assert cache.evict(3) == 4
    assert pool.freed == [[2, 3], [4, 5], [0, 1]]
    assert cache.evict(1) == 0 and cache.total_size() == 0
    cache.check_integrity(in_use=0)


def test_a_parent_is_evicted_after_its_children() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 2, 3, 4])  # [0, 1, 2, 3], t1
    took = insert_new(cache, pool, [1, 2, 3, 5])  # t2: splits [1, 2, 3] | [4], [5]
    assert took == [7]
    tail = insert_new(cache, pool, [9, 9])  # t3
    pool.freed.clear()
    # leaves by age: [4] (t1), [5] (t2); then [1, 2, 3] (t2) is a leaf, older than [9, 9]
    assert cache.evict(100) == 7
    assert pool.freed == [[3], [7], [0, 1, 2], tail]
    cache.check_integrity(in_use=0)


def test_locked_paths_survive_evict() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 2, 3, 4])  # [0, 1, 2, 3]
    other = insert_new(cache, pool, [1, 2, 5, 6])  # splits at [1, 2]
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    pool.freed.clear()
    assert cache.evict(100) == 2
    assert pool.freed == [other]
    assert cache.match_prefix([1, 2, 3, 4]).slots == [0, 1, 2, 3]
    assert (cache.protected_size(), cache.evictable_size()) == (4, 0)
    cache.check_integrity(in_use=0)
    cache.unlock(m.node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    assert cache.evict(100) == 4 and pool.num_free() == pool.num_slots
    cache.check_integrity(in_use=0)


def test_a_leaf_skipped_while_locked_is_evictable_after_unlock() -> None:
    cache, pool = make_cache()
    took = insert_new(cache, pool, [1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    assert cache.evict(100) == 0  # pops the leaf's heap entry and drops it: locked
    cache.unlock(node)
    pool.freed.clear()
    assert cache.evict(100) == 2 and pool.freed == [took]
    cache.check_integrity(in_use=0)


def test_a_split_keeps_handles_and_locks_valid() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    upper = cache.match_prefix([1, 2, 9]).node  # splits the locked node
    assert (upper.key, upper.lock_ref, node.key, node.lock_ref) == ([1, 2], 1, [3, 4], 1)
    assert cache.protected_size() == 4
    cache.check_integrity(in_use=0)
    cache.unlock(node)
    assert (upper.lock_ref, cache.evictable_size()) == (0, 4)
    cache.check_integrity(in_use=0)


def test_lock_refs_count_every_lock_below_a_node() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 2, 3])
    insert_new(cache, pool, [1, 2, 4])
    a = cache.match_prefix([1, 2, 3]).node
    b = cache.match_prefix([1, 2, 4]).node
    shared = a.parent
    assert shared is b.parent and shared is not None and shared.key == [1, 2]
    cache.lock(a)
    cache.lock(b)
    cache.lock(b)
    assert (a.lock_ref, b.lock_ref, shared.lock_ref) == (1, 2, 3)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 0)
    cache.unlock(b)
    cache.unlock(b)
    assert (b.lock_ref, shared.lock_ref) == (0, 1)
    assert (cache.protected_size(), cache.evictable_size()) == (3, 1)
    assert cache.evict(100) == 1  # only [4]
    cache.check_integrity(in_use=0)
    cache.unlock(a)
    cache.check_integrity(in_use=0)


def test_misuse_of_handles_raises() -> None:
    cache, pool = make_cache()
    cache.lock(cache.root)  # a handle that matched nothing: a no-op
    cache.unlock(cache.root)
    node = cache.insert([1, 2], pool.allocate(2)).node
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    cache.evict(2)
    with pytest.raises(ValueError, match="not in this tree"):
        cache.lock(node)
    with pytest.raises(ValueError, match="not in this tree"):
        cache.lock(NullCache(pool).root)
    with pytest.raises(ValueError, match="did not come from"):
        NullCache(pool).lock(node)


def test_reset_returns_every_slot_and_refuses_while_locked() -> None:
    cache, pool = make_cache()
    insert_new(cache, pool, [1, 2, 3])
    node = cache.insert([1, 2, 4, 5], pool.allocate(4)).node
    pool.free([3, 4])  # the duplicates of [1, 2]
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert pool.num_free() == pool.num_slots and cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3]).slots == []
    with pytest.raises(ValueError, match="not in this tree"):
        cache.lock(node)
    cache.check_integrity(in_use=0)


def test_integrity_check_catches_a_double_free_and_a_leak() -> None:
    cache, pool = make_cache()
    slots = pool.allocate(3)
    cache.insert([1, 2, 3], slots)
    cache.check_integrity(in_use=0)
    with pytest.raises(AssertionError, match="KV leak"):
        cache.check_integrity(in_use=1)
    pool.free(slots[:1])  # a slot the tree owns
    with pytest.raises(AssertionError, match="also free"):
        cache.check_integrity(in_use=-1)


# -- pages -----------------------------------------------------------------------------------


def test_page_size_2_caches_and_matches_whole_pages() -> None:
    cache, pool = make_cache(page_size=2)
    slots = pool.allocate(5)
    r = cache.insert([1, 2, 3, 4, 5], slots)
    assert (r.cached_len, r.tree_len) == (0, 4)
    pool.free(slots[r.tree_len :])  # the half page [5] stays the caller's
    cache.check_integrity(in_use=0)
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == [0, 1, 2, 3]
    assert cache.match_prefix([1, 2, 3, 9]).slots == [0, 1]  # split on the page border
    assert cache.match_prefix([1, 2, 3]).slots == [0, 1]
    assert cache.match_prefix([1, 9, 3, 4]).slots == []
    assert cache.match_prefix([1]).slots == []
    s2 = pool.allocate(4)
    r2 = cache.insert([1, 2, 3, 7], s2)  # [3, 7] differs inside its first page
    assert (r2.cached_len, r2.tree_len) == (2, 4)
    pool.free(s2[:2])
    shared = cache.match_prefix([1, 2]).node
    assert set(shared.children) == {(3, 4), (3, 7)}
    assert cache.match_prefix([1, 2, 3, 7]).slots == [0, 1, *s2[2:]]
    cache.check_integrity(in_use=0)


def test_page_size_4_truncates_keys() -> None:
    cache, pool = make_cache(page_size=4)
    slots = pool.allocate(10)
    r = cache.insert(list(range(1, 11)), slots)
    assert (r.cached_len, r.tree_len) == (0, 8)
    pool.free(slots[8:])
    assert cache.match_prefix([1, 2, 3]).slots == []
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0]).slots == slots[:4]
    assert cache.match_prefix(list(range(1, 12))).slots == slots[:8]
    assert cache.total_size() == 8
    cache.check_integrity(in_use=0)
    assert cache.evict(1) == 4  # the leaf [5..8]
    cache.check_integrity(in_use=0)


# -- the request lifecycle, the same code with either cache ----------------------------------


@dataclass
class Running:
    key: list[int]  # tokens whose KV is in slots
    slots: list[int]
    node: TreeNode  # locked
    locked_len: int  # slots[:locked_len] are the tree's

    def owned(self) -> int:
        return len(self.slots) - self.locked_len


def admit(cache: PrefixCache, pool: KVPool, prompt: list[int]) -> Running:
    m = cache.match_prefix(prompt[:-1])
    cache.lock(m.node)
    slots = m.slots + pool.allocate(len(prompt) - len(m.slots))
    return Running(list(prompt), slots, m.node, len(m.slots))


def decode(pool: KVPool, req: Running, token: int) -> None:
    req.key.append(token)
    req.slots += pool.allocate(1)


def checkpoint(cache: PrefixCache, pool: KVPool, req: Running) -> None:
    """Insert a request that keeps running, and switch it to the tree's copies."""
    r = cache.insert(req.key, req.slots)
    pool.free(req.slots[req.locked_len : r.cached_len])
    m = cache.match_prefix(req.key)
    assert len(m.slots) == r.tree_len and m.node is r.node
    req.slots[: len(m.slots)] = m.slots
    cache.lock(m.node)
    cache.unlock(req.node)
    req.node, req.locked_len = m.node, len(m.slots)


def finish(cache: PrefixCache, pool: KVPool, req: Running) -> int:
    r = cache.insert(req.key, req.slots)
    pool.free(req.slots[req.locked_len : r.cached_len])
    pool.free(req.slots[r.tree_len :])
    cache.unlock(req.node)
    return r.cached_len


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kind", ["radix", "null"])
def test_request_lifecycle_keeps_integrity(kind: str, page_size: int) -> None:
    pool = LoggedPool(64)
    cache: PrefixCache = (RadixCache if kind == "radix" else NullCache)(pool, page_size)
    shared = 8 if kind == "radix" else 0
    system = [100 + i for i in range(8)]
    live: list[Running] = []

    def check() -> None:
        cache.check_integrity(in_use=sum(r.owned() for r in live))

    a = admit(cache, pool, [*system, 10, 11, 12])
    b = admit(cache, pool, [*system, 20, 21])  # concurrent: A is not in the tree yet
    live += [a, b]
    assert a.locked_len == b.locked_len == 0
    check()
    decode(pool, a, 13)
    decode(pool, a, 14)
    check()
    checkpoint(cache, pool, a)  # 13 tokens: page 1 caches all, page 4 caches 12
    assert a.locked_len == (0 if kind == "null" else 13 - 13 % page_size)
    check()
    assert finish(cache, pool, b) == shared  # b's copy of the system prompt was a duplicate
    live.remove(b)
    check()
    c = admit(cache, pool, [*system, 30])
    live.append(c)
    assert c.locked_len == shared and c.slots[:shared] == a.slots[:shared]
    check()
    evictable = cache.evictable_size()
    assert cache.evict(1000) == evictable  # b's own tail, if cached; a and c are locked
    check()
    decode(pool, c, 31)
    finish(cache, pool, a)
    live.remove(a)
    check()
    finish(cache, pool, c)
    live.remove(c)
    check()
    assert cache.protected_size() == 0
    cache.evict(pool.num_slots)
    assert pool.num_free() == pool.num_slots
    check()
