"""Which requests run in the next step. Synchronous; no I/O, no model.

Each step is either an EXTEND (prompt chunks of admitted requests, under a token budget) or a
DECODE (one token for every running request, plus any text a grammar forced after it, which
makes the step an EXTEND too). While prompts wait and requests decode, the two alternate, so
a long prompt never stalls generation for the others.

Admission order: longest cached prefix first (`lpm`) or arrival order (`fcfs`); a request
passed over STARVATION_WAITS times goes first. A request sharing a long prefix with a prompt
being computed right now waits for it to land in the cache instead of computing it again.

Memory: requests are admitted while the pool (free plus evictable cached slots) can hold their
pending tokens plus an estimate of their output: `new_token_ratio` of the tokens each may still
generate. The ratio decays while decoding goes well and jumps back up on a retraction. When
decoding runs out of slots, cached prefixes are evicted first, then the youngest running
requests are retracted to the queue, keeping their tokens; their KV goes to the cache, so
readmission recomputes only what was evicted meanwhile.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.executor.extend_rows import counts_fit
from services.executor.memory import KVManager
from services.executor.request import Req

# Admission estimate: new_token_ratio * min(tokens left to generate, ESTIMATE_CLIP).
ESTIMATE_CLIP = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step
STARVATION_WAITS = 64  # admissions a request may be passed over before it goes first
LPM_MAX_QUEUE = 256  # above this many waiting, matching each one costs more than it saves
SHARED_PREFIX_MIN = 32  # tokens in common with an in-flight prompt that make a request wait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolUsage:
    """KV slots, for the heartbeat: free, all of them, held by the prefix cache, and of
    those, held by nobody else (evictable)."""

    free: int
    total: int
    cached: int
    evictable: int


@dataclass
class StepPlan:
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request this step
    is_decode: bool

    def __post_init__(self) -> None:
        # Slots for this step are allocated at planning, so kv_len counts them. A prefill-only
        # request samples nothing: its prompt's end is its end.
        # (Req.kv_len == Req.all_len, inlined: this runs over every request every step)
        self.sampling = [
            len(r.slots) == len(r.input_ids) + len(r.output_ids) + r.pending and not r.prefill_only
            for r in self.reqs
        ]

    def samples(self, i: int) -> bool:
        """Whether request i gets a new token this step (a prompt chunk short of the end
        does not)."""
        return self.sampling[i]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class BatchPolicy:
    def __init__(
        self,
        memory: KVManager,
        max_running: int,
        max_prefill_tokens: int,
        schedule_policy: str = "lpm",
        jump_extend_min: float = 0.0,
    ) -> None:
        if schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"unknown schedule policy {schedule_policy!r}: lpm or fcfs")
        self.mem = memory
        self.kv = memory.kv
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.schedule_policy = schedule_policy
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully computed
        self.running: list[Req] = []  # decoding
        self.live: dict[str, Req] = {}  # rid -> every request above: the one registry
        self._last_was_extend = False
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retracted = 0
        # Forced text (jump-forward) rides in an EXTEND step only when it carries at least
        # this many forced tokens per running request; below that, each request feeds its next
        # forced token into an ordinary decode step. With CUDA graphs a decode step is replayed
        # and an EXTEND runs eagerly, costing up to two decode steps at large batches: a few
        # forced tokens among 64 requests would slow every request down. 0: always extend.
        self.jump_extend_min = jump_extend_min
        # The most tokens a step runs as decode rows replayed from the graphs
        # (extend_rows.py; the builder gives the runner's `rows_limit`, 0: none): forced text
        # within it extends whatever its count, since such a step costs about a decode step
        # of that many rows.
        self.rows_limit: Callable[[], int] = lambda: 0
        self.jump_extended_tokens = 0  # forced tokens computed beside a request's next token

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)
        self.live[req.rid] = req

    def find(self, rid: str) -> Req | None:
        return self.live.get(rid)

    def usage(self) -> PoolUsage:
        cache = self.mem.cache
        return PoolUsage(
            free=self.kv.num_free(),
            total=self.kv.num_slots,
            cached=cache.total_size(),
            evictable=cache.evictable_size(),
        )

    def all_reqs(self) -> list[Req]:
        return [*self.waiting, *self.prefilling, *self.running]

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def remove(self, req: Req) -> None:
        """Take a request out wherever it is; its computed tokens go to the cache."""
        for group in (self.prefilling, self.running):
            if req in group:
                group.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.live.pop(req.rid, None)
        self.mem.release(req)

    # -- planning ----------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """The next step, with KV slots already allocated for its new tokens."""
        want_extend = bool(self.waiting or self.prefilling)
        if want_extend and not (self.running and self._last_was_extend):
            plan = self._plan_extend()
            if plan is not None:
                self._last_was_extend = True
                return plan
        self._last_was_extend = False
        return self._plan_decode()

    def _estimate(self, r: Req) -> int:
        """Slots request r is expected to still need: its pending tokens plus a share of the
        output it may still generate."""
        left = min(r.max_new_tokens - len(r.output_ids), ESTIMATE_CLIP)
        return r.pending_len + int(left * self.new_token_ratio)

    def _order_waiting(self) -> None:
        if self.schedule_policy == "fcfs" or len(self.waiting) > LPM_MAX_QUEUE:
            return
        matched = {r.rid: self.mem.match_len(r) for r in self.waiting}
        self.waiting = deque(
            sorted(
                self.waiting,
                key=lambda r: (r.waits < STARVATION_WAITS, -matched[r.rid], r.seq),
            )
        )

    def _shares_inflight_prefix(self, req: Req) -> bool:
        """Whether a prompt being computed now covers a long prefix of req's that the cache
        does not have yet: req is better off waiting for it than computing it again."""
        cached = self.mem.match_len(req)
        # Most pairs differ early: a slice of SHARED_PREFIX_MIN tokens tells, where the full
        # comparison copies both prompts (256 prompts of 2,048 tokens admitted at once: 32,640
        # pairs, 0.3 s of one step's planning).
        head = req.input_ids[:SHARED_PREFIX_MIN]
        for other in self.prefilling:
            if other.input_ids[:SHARED_PREFIX_MIN] != head:
                continue  # they share fewer than SHARED_PREFIX_MIN tokens
            shared = common_prefix_len(req.input_ids, other.input_ids)
            if shared >= SHARED_PREFIX_MIN and shared > cached + SHARED_PREFIX_MIN:
                return True
        return False

    def _admit(self) -> None:
        self._order_waiting()
        reserved = sum(self._estimate(r) for r in (*self.prefilling, *self.running))
        deferred: list[Req] = []
        while self.waiting and len(self.prefilling) + len(self.running) < self.max_running:
            req = self.waiting[0]
            if self.mem.rows.num_free() == 0:
                break
            if req.waits < STARVATION_WAITS and self._shares_inflight_prefix(req):
                deferred.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.mem.attach(req)
            need = self._estimate(req)
            alone = not self.prefilling and not self.running
            room = self.mem.available()
            if need > room - reserved and not (alone and req.pending_len <= room):
                self.mem.release(req)
                self.waiting.appendleft(req)
                break
            self.prefilling.append(req)
            reserved += need
        for r in self.waiting:
            r.waits += 1
        self.waiting.extendleft(reversed(deferred))

    def _plan_extend(self) -> StepPlan | None:
        self._admit()
        while self.prefilling:
            plan, out_of_memory = self._extend_chunks()
            if plan is not None or not out_of_memory or self.running:
                return plan
            # Partly prefilled prompts hold the whole pool: give the youngest's slots to the
            # others so at least one can finish (it waits to be admitted again). Only prompts
            # that still need slots count: a prefill-only request whose last chunk is in
            # flight needs none and is about to finish.
            needing = [r for r in self.prefilling if not r.pending and r.pending_len > 0]
            if len(needing) < 2:
                return None
            victim = max(needing, key=lambda r: r.seq)
            self.prefilling.remove(victim)
            self.mem.release(victim)
            self.waiting.appendleft(victim)
        return None

    def _extend_chunks(self) -> tuple[StepPlan | None, bool]:
        """The next chunk of each prefilling prompt, within the token budget; and whether a
        prompt found no free slot."""
        reqs: list[Req] = []
        lens: list[int] = []
        budget = self.max_prefill_tokens
        for req in self.prefilling:
            if budget <= 0:
                break
            if req.pending or req.pending_len == 0:
                # Its last chunk is in flight (overlap): the token it samples starts its
                # decoding, which a CUDA graph replays far cheaper than a one-token extend;
                # a prefill-only request samples none and has nothing left to compute.
                continue
            n = min(req.pending_len, budget, self.mem.available())
            if n <= 0:
                return (StepPlan(reqs, lens, is_decode=False) if reqs else None), True
            self.mem.grow(req, n)
            reqs.append(req)
            lens.append(n)
            budget -= n
        return (StepPlan(reqs, lens, is_decode=False) if reqs else None), False

    def _plan_decode(self) -> StepPlan | None:
        """One token for every running request, plus the tokens a grammar forced after it
        (jump-forward): those ride along in the same step, which is then an EXTEND, so that
        requests with and without forced text never wait for each other's steps. When the
        forced tokens are too few to pay for an EXTEND (`jump_extend_min`), every request
        takes one token: its next forced one, or the one it sampled."""
        if not self.running:
            return None
        need = self.decode_need()
        while not self.mem.make_room(need) and len(self.running) > 1:
            self.retract_youngest()
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            need = self.decode_need()
        if not self.mem.make_room(need):
            raise MemoryError("the KV pool cannot hold even one decoding request")
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        # Requests whose last token is still in flight and that may not sample another one
        # (Req.exhausted) are left out: they finish when that token lands. Req's length
        # properties are inlined here, as in decode_need: this loop runs every step.
        reqs: list[Req] = []
        lens: list[int] = []
        for r in self.running:
            all_len = len(r.input_ids) + len(r.output_ids) + r.pending
            if r.finish is None and all_len < r.limit_len:
                reqs.append(r)
                lens.append(all_len - len(r.slots))
        if not reqs:
            return None
        extra = sum(lens) - len(lens)
        if (
            extra
            and extra < self.jump_extend_min * len(lens)
            # a step that runs as decode rows costs about a decode step of its rows
            and not counts_fit([len(r.slots) for r in reqs], lens, self.rows_limit())
        ):
            lens = [1] * len(lens)  # a request with forced text samples nothing this step
        else:
            self.jump_extended_tokens += extra
        self.mem.grow_all(reqs, lens)
        return StepPlan(reqs, lens, is_decode=lens.count(1) == len(lens))

    def decode_need(self) -> int:
        """KV slots the next decode step takes: each running request's uncomputed tokens
        (Req.pending_len, inlined)."""
        return sum(
            len(r.input_ids) + len(r.output_ids) + r.pending - len(r.slots) for r in self.running
        )

    def retract_youngest(self) -> Req:
        """Put the most recently arrived running request back at the head of the queue. Its
        output so far is kept: it is recomputed as part of its prompt when readmitted."""
        victim = max(self.running, key=lambda r: r.seq)
        self.num_retracted += 1
        self.running.remove(victim)
        self.mem.release(victim)
        self.waiting.appendleft(victim)
        log.info(
            "KV pool full: retracted %s after %d output tokens (%d retractions so far)",
            victim.rid,
            len(victim.output_ids),
            self.num_retracted,
        )
        return victim

    # -- after the forward pass --------------------------------------------------------------
    def after_step(self, plan: StepPlan) -> None:
        """Move finished prompts to running (sharing them through the cache); drop finished
        requests, their tokens going to the cache."""
        for req, sampled in zip(plan.reqs, plan.sampling, strict=True):
            if req.prefill_only and req.finish is None and req.kv_len == req.all_len:
                req.finish = "length"  # its prompt is computed: it is done
            if req.finish is not None:
                if req in self.prefilling:
                    self.prefilling.remove(req)
                elif req in self.running:
                    self.running.remove(req)
                self.live.pop(req.rid, None)
                self.mem.release(req)
            elif sampled and req in self.prefilling:
                # Its prompt is computed; text a grammar forced after the sampled token (if
                # any) is computed with the next decode step.
                self.prefilling.remove(req)
                self.running.append(req)
                self.mem.cache_prefix(req)

    def check_integrity(self) -> None:
        self.mem.check_integrity([*self.prefilling, *self.running])
