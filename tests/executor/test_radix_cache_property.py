"""Random request lifecycles and evictions against a brute-force model of the cache.

The model is a dict from every cached prefix of whole pages (a tuple of tokens) to the slots
of its last page, plus the logical time each prefix was last used. Pages are distinct when
any token differs: [0, 0] and [0, 1] with page size 2 are two pages, each with its own slot for
the first 0. After every step: check_integrity, the tree
holds exactly the model's prefixes and slots, every node's lock_ref equals the number of
running requests locked at or below it, and the size counters match the model.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from services.executor.cache import NullCache, PrefixCache, RadixCache, TreeNode
from tests.executor.test_radix_cache import LoggedPool, Running

POOL_SLOTS = 40
keys = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = LoggedPool(POOL_SLOTS)
        self.cache: PrefixCache = RadixCache(self.pool)
        self.page = 1
        # cached prefix (whole pages) -> slots of its last page
        self.model: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.used: dict[tuple[int, ...], int] = {}  # cached prefix -> time of last use
        self.clock = 0
        self.running: list[Running] = []

    @initialize(kind=st.sampled_from(["radix", "null"]), page=st.sampled_from([1, 2, 3]))
    def setup(self, kind: str, page: int) -> None:
        self.page = page
        self.cache = (RadixCache if kind == "radix" else NullCache)(self.pool, page)

    # -- the model ---------------------------------------------------------------------------
    def model_match(self, key: list[int]) -> int:
        n, p = 0, self.page
        while n + p <= len(key) and tuple(key[: n + p]) in self.model:
            n += p
        return n

    def model_slots(self, key: list[int], n: int) -> list[int]:
        p = self.page
        return [s for i in range(0, n, p) for s in self.model[tuple(key[: i + p])]]

    def touch(self, key: list[int], n: int) -> None:
        self.clock += 1
        for i in range(self.page, n + 1, self.page):
            self.used[tuple(key[:i])] = self.clock

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        p = self.page
        return {tuple(r.key[:i]) for r in self.running for i in range(p, r.locked_len + 1, p)}

    def match_checked(self, key: list[int]) -> tuple[list[int], TreeNode]:
        n = self.model_match(key)
        m = self.cache.match_prefix(key)
        assert m.slots == self.model_slots(key, n)
        assert m.node.depth == n
        self.touch(key, n)
        return m.slots, m.node

    def make_room(self, need: int) -> bool:
        if self.pool.num_free() < need:
            self.evict_checked(need - self.pool.num_free())
        return self.pool.num_free() >= need

    def evict_checked(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        locked = self.locked_prefixes()
        parents = {q[: -self.page] for q in self.model}
        leaves = {q for q in self.model if q not in locked and q not in parents}
        logged = len(self.pool.freed)
        freed = self.cache.evict(n)
        assert freed == evictable if n >= evictable else freed >= n
        slots = {s for batch in self.pool.freed[logged:] for s in batch}
        removed = {q for q, page in self.model.items() if page[0] in slots}
        assert len(slots) == len(removed) * self.page == freed
        assert not removed & locked
        survivors = leaves - removed
        if removed and survivors:  # LRU: nothing evicted was used after a surviving leaf
            assert max(self.used[p] for p in removed) <= min(self.used[p] for p in survivors)
        for p in removed:
            del self.model[p], self.used[p]

    def insert_checked(self, req: Running) -> tuple[int, int]:
        before = self.model_match(req.key)
        assert req.slots[: req.locked_len] == self.model_slots(req.key, req.locked_len)
        r = self.cache.insert(req.key, req.slots)
        assert r.cached_len == before >= req.locked_len
        if isinstance(self.cache, RadixCache):
            assert r.tree_len == len(req.key) - len(req.key) % self.page
        else:
            assert r.tree_len == 0
        for i in range(r.cached_len, r.tree_len, self.page):
            self.model[tuple(req.key[: i + self.page])] = tuple(req.slots[i : i + self.page])
        self.touch(req.key, r.tree_len)
        self.pool.free(req.slots[req.locked_len : r.cached_len])
        return r.cached_len, r.tree_len

    # -- rules -------------------------------------------------------------------------------
    @rule(key=keys)
    def match(self, key: list[int]) -> None:
        self.match_checked(key)

    @rule(i=st.integers(0, 100))
    def match_cached(self, i: int) -> None:
        """Use a cached prefix again, often a whole leaf: its eviction heap entry goes stale."""
        if self.model:
            self.match_checked(list(sorted(self.model)[i % len(self.model)]))

    @rule(prompt=keys.filter(bool))
    def admit(self, prompt: list[int]) -> None:
        slots, node = self.match_checked(prompt)
        self.cache.lock(node)
        need = len(prompt) - len(slots)
        if not self.make_room(need):
            self.cache.unlock(node)
            return
        self.running.append(Running(prompt, slots + self.pool.allocate(need), node, len(slots)))

    @rule(i=st.integers(0, 100), tokens=keys.filter(bool))
    def decode(self, i: int, tokens: list[int]) -> None:
        if self.running and self.make_room(len(tokens)):
            req = self.running[i % len(self.running)]
            req.key += tokens
            req.slots += self.pool.allocate(len(tokens))

    @rule(i=st.integers(0, 100))
    def checkpoint(self, i: int) -> None:
        if not self.running:
            return
        req = self.running[i % len(self.running)]
        self.insert_checked(req)
        slots, node = self.match_checked(req.key)
        req.slots[: len(slots)] = slots
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node, req.locked_len = node, len(slots)

    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        if not self.running:
            return
        req = self.running.pop(i % len(self.running))
        _, tree_len = self.insert_checked(req)
        self.pool.free(req.slots[tree_len:])
        self.cache.unlock(req.node)

    @rule(n=st.integers(0, 8))  # small: a few leaves go, the LRU order shows
    def evict(self, n: int) -> None:
        self.evict_checked(n)

    @rule(draw=st.integers(0, 3))
    def reset(self, draw: int) -> None:
        if draw:  # rarely: a reset empties what the other rules build up
            return
        if self.cache.protected_size():
            try:
                self.cache.reset()
            except RuntimeError:
                return
            raise AssertionError("reset with locked nodes did not raise")
        self.cache.reset()
        self.model.clear()
        self.used.clear()
        assert self.pool.num_free() == POOL_SLOTS - sum(r.owned() for r in self.running)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity(in_use=sum(r.owned() for r in self.running))
        tree: dict[tuple[int, ...], tuple[int, ...]] = {}
        nodes: list[TreeNode] = []
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(self.cache.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                nodes.append(child)
                p = prefix
                for i in range(0, len(child.key), self.page):
                    p = (*p, *child.key[i : i + self.page])
                    tree[p] = tuple(child.slots[i : i + self.page])
                stack.append((child, p))
        assert tree == self.model
        locks: dict[int, int] = {}
        for r in self.running:
            node = r.node
            while node.parent is not None:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent
        assert {id(n): n.lock_ref for n in nodes if n.lock_ref} == locks
        protected = len(self.locked_prefixes()) * self.page
        assert self.cache.protected_size() == protected
        assert self.cache.evictable_size() == len(self.model) * self.page - protected


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow],
)
