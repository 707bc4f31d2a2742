"""Which requests run in the next step, and their KV memory. Synchronous; no I/O, no model.

Each step is either an EXTEND (prefill chunks of waiting requests, under a token budget) or a
DECODE (one token for every running request). While prompts wait and requests decode, the two
alternate, so a long prompt never stalls generation for the others. Requests are admitted while
the KV pool can hold their prompt plus an estimate of their output: `new_token_ratio` of the
tokens each may still generate. The ratio decays while decoding goes well (most requests stop
long before max_tokens) and jumps back up on a retraction. When decoding runs out of slots,
the youngest running requests are retracted to the queue, keeping their tokens, and recomputed
later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.request import Req

# Admission estimate: new_token_ratio * min(tokens left to generate, ESTIMATE_CLIP).
ESTIMATE_CLIP = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step


@dataclass
class StepPlan:
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request this step
    is_decode: bool

    def samples(self, i: int) -> bool:
        """Whether request i gets a new token this step (a prompt chunk short of the end
        does not). Slots for this step are allocated at planning, so kv_len counts them."""
        r = self.reqs[i]
        return r.kv_len == r.all_len


class BatchPolicy:
    def __init__(
        self,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        max_running: int,
        max_prefill_tokens: int,
    ) -> None:
        self.kv = kv_pool
        self.rows = req_pool
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully computed
        self.running: list[Req] = []  # decoding
        self._last_was_extend = False
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retracted = 0

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def all_reqs(self) -> list[Req]:
        return [*self.waiting, *self.prefilling, *self.running]

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def remove(self, req: Req) -> None:
        """Take a request out wherever it is and free its memory."""
        for group in (self.prefilling, self.running):
            if req in group:
                group.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def release(self, req: Req) -> None:
        self.kv.free(req.slots)
        req.slots = []
        if req.row >= 0:
            self.rows.free(req.row)
            req.row = -1

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

    def _reserved(self) -> int:
        return sum(self._estimate(r) for r in (*self.prefilling, *self.running))

    def _admit(self) -> None:
        budget = self.kv.num_free() - self._reserved()
        while self.waiting and len(self.prefilling) + len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self._estimate(req)
            alone = not self.prefilling and not self.running
            if need > budget and not (alone and req.pending_len <= self.kv.num_free()):
                break
            if self.rows.num_free() == 0:
                break
            self.waiting.popleft()
            req.row = self.rows.allocate()
            self.prefilling.append(req)
            budget -= need

    def _plan_extend(self) -> StepPlan | None:
        self._admit()
        if not self.prefilling:
            return None
        reqs: list[Req] = []
        lens: list[int] = []
        budget = self.max_prefill_tokens
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.pending_len, budget, self.kv.num_free())
            if n <= 0:
                break
            self._grow(req, n)
            reqs.append(req)
            lens.append(n)
            budget -= n
        if not reqs:
            if self.prefilling and not self.running:
                # Partly prefilled prompts hold the whole pool: give the youngest's slots to
                # the others so at least one can finish.
                victim = max(self.prefilling, key=lambda r: r.seq)
                self.prefilling.remove(victim)
                self.release(victim)
                self.waiting.appendleft(victim)
                return self._plan_extend() if self.prefilling else None
            return None
        return StepPlan(reqs, lens, is_decode=False)

    def _plan_decode(self) -> StepPlan | None:
        if not self.running:
            return None
        while self.kv.num_free() < len(self.running) and len(self.running) > 1:
            self.retract_youngest()
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        if self.kv.num_free() < len(self.running):
            raise MemoryError("the KV pool cannot hold even one decoding request")
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        for req in self.running:
            self._grow(req, 1)
        return StepPlan(list(self.running), [1] * len(self.running), is_decode=True)

    def _grow(self, req: Req, n: int) -> None:
        start = req.kv_len
        slots = self.kv.allocate(n)
        self.rows.write(req.row, start, slots)
        req.slots.extend(slots)

    def retract_youngest(self) -> Req:
        """Put the most recently arrived running request back at the head of the queue. Its
        output so far is kept: it is recomputed as part of its prompt when readmitted."""
        victim = max(self.running, key=lambda r: r.seq)
        self.num_retracted += 1
        self.running.remove(victim)
        self.release(victim)
        self.waiting.appendleft(victim)
        return victim

    # -- after the forward pass --------------------------------------------------------------
    def after_step(self, plan: StepPlan) -> None:
        """Move finished prompts to running; drop finished requests and free their memory."""
        for req in plan.reqs:
            if req.finish is not None:
                if req in self.prefilling:
                    self.prefilling.remove(req)
                elif req in self.running:
                    self.running.remove(req)
                self.release(req)
            elif req in self.prefilling and req.pending_len == 1 and req.output_ids:
                self.prefilling.remove(req)
                self.running.append(req)

    def check_integrity(self) -> None:
        used = sum(r.kv_len for r in (*self.prefilling, *self.running))
        assert self.kv.num_free() + used == self.kv.num_slots, (
            f"KV leak: free {self.kv.num_free()} + used {used} != {self.kv.num_slots}"
        )
