"""Who holds each KV slot: the pool's free list, the prefix cache, or one request.

A resident request's `slots` are the cache's (`slots[:locked_len]`, kept alive by a lock on
`locked_node`) followed by its own. The ownership rule of every hand-over is the one in
cache/base.py; this is the only module that applies it.
"""

from __future__ import annotations

from services.executor.cache import PrefixCache
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.request import Req


class KVManager:
    def __init__(self, kv: KVPool, rows: ReqToTokenPool, cache: PrefixCache) -> None:
        self.kv = kv
        self.rows = rows
        self.cache = cache

    def available(self) -> int:
        """Slots a request could get now: free ones plus cached ones nobody is using."""
        return self.kv.num_free() + self.cache.evictable_size()

    def match_len(self, req: Req) -> int:
        """Tokens of the request the cache already holds (at least one is left to compute)."""
        return len(self.cache.match_prefix(req.token_range(0, req.match_limit)).slots)

    def attach(self, req: Req) -> None:
        """Make the request resident: a request row, and the cache's longest prefix, locked."""
        assert req.row < 0 and not req.slots, f"{req.rid} is already resident"
        m = self.cache.match_prefix(req.token_range(0, req.match_limit))
        self.cache.lock(m.node)
        req.locked_node, req.locked_len = m.node, len(m.slots)
        req.row = self.rows.allocate()
        req.slots = list(m.slots)
        self.rows.write(req.row, 0, req.slots)
        if not req.attached:  # first admission: this is what usage reports
            req.cached_tokens = min(len(m.slots), len(req.input_ids))  # of the prompt
            req.attached = True

    def grow(self, req: Req, n: int) -> None:
        """Allocate slots for the request's next n tokens, evicting cached ones if needed."""
        short = n - self.kv.num_free()
        if short > 0:
            self.cache.evict(short)
        start = req.kv_len
        new = self.kv.allocate(n)
        self.rows.write(req.row, start, new)
        req.slots.extend(new)

    def grow_all(self, reqs: list[Req], lens: list[int]) -> None:
        """`grow(req, n)` for each pair, in one allocation and one table write when the free
        list holds them all (a decode step: make_room ran first). The slots are those the
        calls one by one would give, in the same order."""
        total = sum(lens)
        if total > self.kv.num_free():  # eviction on the way: one at a time, as grow does
            for req, n in zip(reqs, lens, strict=True):
                self.grow(req, n)
            return
        new = self.kv.allocate(total)
        self.rows.write_many([r.row for r in reqs], [len(r.slots) for r in reqs], lens, new)
        at = 0
        for req, n in zip(reqs, lens, strict=True):
            req.slots += new[at : at + n]
            at += n

    def make_room(self, n: int) -> bool:
        """Evict until n slots are free; whether that worked."""
        short = n - self.kv.num_free()
        if short > 0:
            self.cache.evict(short)
        return self.kv.num_free() >= n

    def cache_prefix(self, req: Req) -> None:
        """Share a running request's computed tokens: insert them into the cache and switch
        the request to the cache's copies, so requests arriving now can reuse them."""
        key = req.token_range(0, req.kv_len)
        r = self.cache.insert(key, req.slots)
        self.kv.free(req.slots[req.locked_len : r.cached_len])
        m = self.cache.match_prefix(key)
        self.cache.lock(m.node)
        assert req.locked_node is not None
        self.cache.unlock(req.locked_node)
        switched = len(m.slots)
        if switched > req.locked_len:
            req.slots[:switched] = m.slots
            self.rows.write(req.row, 0, m.slots)
        req.locked_node, req.locked_len = m.node, switched

    def release(self, req: Req) -> None:
        """The request leaves (finished, aborted or retracted): its computed tokens go to the
        cache for the next turn or the recomputation, its row and other slots are freed."""
        if req.row < 0:
            return
        # Only tokens whose values are known go to the cache: a request aborted while a
        # token was in flight has a slot (being written) for a token the host never saw.
        known = min(req.kv_len, req.known_len)
        r = self.cache.insert(req.token_range(0, known), req.slots[:known])
        self.kv.free(req.slots[req.locked_len : r.cached_len])
        self.kv.free(req.slots[r.tree_len :])
        assert req.locked_node is not None
        self.cache.unlock(req.locked_node)
        self.rows.free(req.row)
        req.slots, req.locked_node, req.locked_len, req.row = [], None, 0, -1

    def check_integrity(self, resident: list[Req]) -> None:
        """free + cached + held by requests == pool size, and the tree's own invariants."""
        in_use = sum(len(r.slots) - r.locked_len for r in resident)
        self.cache.check_integrity(in_use)
