"""The executor's synchronous core: requests in, one batch step at a time, token deltas out.

    engine.submit(msg)          # any thread: a request, an abort, a cache flush
    result = engine.step()      # the stepping thread: plan, launch, land, outputs

Each step is planned by the batch policy, run by the model runner (records.Forward), sampled
by the sampler (records.Sampled) and held as the step in flight (records.InFlight) until its
tokens land on the host. With overlap (on a GPU) the next step is launched before the
previous one lands, so the host's bookkeeping runs while the device computes.

Thread-safety: `submit` may be called from the event loop thread while `step` runs in a
worker thread; submissions go through a queue that `step` drains at its start, so the batch
state is only ever touched by the stepping thread.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

from services.executor.batch_policy import BatchPolicy
from services.executor.cuda_device import make_current
from services.executor.engine.admission import Limits, admit
from services.executor.engine.outputs import (
    Outputs,
    StepResult,
    stamp_first_launched,
    stamp_first_on_host,
)
from services.executor.engine.records import Forward, InFlight, Sampled
from services.executor.engine.stats import EngineStats, step_phase
from services.executor.engine.timeline import Timeline, finished_timelines, record_chunks
from services.executor.grammar import lifecycle
from services.executor.grammar.backend import GrammarBackend
from services.executor.model_runner import ModelRunner
from services.executor.request import Req
from services.executor.sampling.processors import needs_history
from services.executor.sampling.step import Sampler
from shared.messages.common import AbortRequest, ErrorInfo
from shared.messages.detok import RequestFailed
from shared.messages.heartbeat import ExecutorLoad
from shared.messages.schedule import ExecutorMessage, FlushCache, TokenizedRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AbortEverything:
    """Submitted by the executor itself, never sent on the bus: end every request it holds.
    Redis restarted empty, so nobody waits for their answers any more (the gateways failed
    them); their KV slots are freed at once."""

    reason: str


class Engine:
    def __init__(
        self,
        name: str,
        stream: str,
        model_name: str,
        context_length: int,
        policy: BatchPolicy,
        runner: ModelRunner,
        sampler: Sampler,
        grammars: GrammarBackend | None = None,
        check_integrity: bool = False,
        overlap: bool | None = None,
    ) -> None:
        self.name, self.stream, self.model_name = name, stream, model_name
        self.context_length = context_length
        self.policy = policy
        self.runner = runner
        self.sampler = sampler
        self.grammars = grammars  # None: this engine refuses constrained requests
        self.limits = Limits(policy.kv.num_slots, runner.vocab_size, context_length)
        # (message, when it was submitted): the submit time is the request's executor_inbox
        self.inbox: queue.SimpleQueue[tuple[ExecutorMessage | AbortEverything, float]] = (
            queue.SimpleQueue()
        )
        self.step_no = 0
        self._seq = 0
        self.check_integrity = check_integrity
        # Overlap needs an asynchronous device; on the CPU it only adds bookkeeping.
        self.overlap = runner.cuda if overlap is None else overlap
        self.inflight: InFlight | None = None
        self.overlapped_steps = 0  # steps launched before the previous one's tokens landed
        self.aborted = 0  # requests ended early (aborted, past their deadline, bus restarted)
        self.stats = EngineStats()  # totals for the metrics, read when they are scraped
        # Tracing on: requests keep a Timeline and finished ones come back in StepResult.traced
        self.trace_requests = False
        self.waiting_tokens = 0  # prompt tokens of the waiting requests, as of the last step

    # -- called from any thread --------------------------------------------------------------
    def submit(self, msg: ExecutorMessage | AbortEverything) -> None:
        self.inbox.put((msg, time.time()))

    def load(self) -> ExecutorLoad:
        p = self.policy
        pool = p.usage()
        stats = self.grammars.stats if self.grammars is not None else None
        return ExecutorLoad(
            stream=self.stream,
            model=self.model_name,
            context_length=self.context_length,
            waiting=len(p.waiting) + self.inbox.qsize(),
            running=len(p.prefilling) + len(p.running),
            free_kv_tokens=pool.free,
            total_kv_tokens=pool.total,
            cached_tokens=pool.cached,
            evictable_tokens=pool.evictable,
            max_running=p.max_running,
            grammar_requests=stats.requests if stats is not None else 0,
            jump_forward_tokens=stats.jump_forward_tokens if stats is not None else 0,
            jump_extended_tokens=p.jump_extended_tokens,
            waiting_tokens=self.waiting_tokens,
            aborted_requests=self.aborted,
            tp_size=self.runner.tp.size,
        )

    # -- the stepping thread -----------------------------------------------------------------
    def has_work(self) -> bool:
        return self.policy.has_work() or not self.inbox.empty() or self.inflight is not None

    def requests(self) -> list[Req]:
        """The requests the engine holds (queued, prefilling, decoding)."""
        return self.policy.all_reqs()

    def step(self) -> StepResult:
        """Plan and launch the next step; land the previous one. With overlap, the device
        computes step N+1 while the host turns step N's tokens into outputs."""
        make_current(self.runner.device)  # the stepping thread may not be the building one
        out = Outputs()
        self._take_inbox(out)
        self._expire(out)
        prev = self.inflight
        if prev is not None and not self._can_overlap():
            self._land(prev, out)
            prev = None
        nxt = self._launch(prev)
        if prev is not None:
            self._land(prev, out)
        if nxt is not None and nxt.deferred:  # its grammar masks needed prev's tokens
            nxt = nxt.with_sampled(self._sample(nxt.forward, nxt.indices))
        self.inflight = nxt if self.overlap else None
        if nxt is not None and not self.overlap:
            self._land(nxt, out)
        return self._result(out, nxt)

    def _launch(self, prev: InFlight | None) -> InFlight | None:
        """Plan the next step and queue it on the device; its sampling too, unless a request
        of it has a grammar whose mask needs the tokens of `prev`, still in flight."""
        plan = self.policy.plan()
        if plan is None:
            return None
        started = time.time()
        forward = self.runner.forward(plan, prev)
        indices = [plan.reqs[i].begin_token() for i in forward.rows]
        defer = prev is not None and any(r.grammar is not None for r in plan.reqs)
        sampled = None if defer else self._sample(forward, indices)
        if not plan.is_decode:  # decode steps carry no request's first token
            stamp_first_launched((plan.reqs[i] for i in forward.rows), started)
            if self.trace_requests:
                record_chunks(plan.reqs, plan.extend_lens, started)
        self.stats.launched(step_phase(plan.is_decode, forward.as_rows), sum(plan.extend_lens))
        self.overlapped_steps += prev is not None
        self.step_no += 1
        return InFlight(forward, indices, sampled)

    def _sample(self, forward: Forward, indices: list[int]) -> Sampled:
        """Sample the step; under tensor parallelism its tokens go to the other ranks too."""
        sampled = self.sampler.sample(forward, indices)
        self.runner.share(sampled)
        return sampled

    def _land(self, step: InFlight, out: Outputs) -> None:
        """The step's tokens reached the host: record them, retire finished requests."""
        tokens = self._tokens_on_host(step)
        on_host = time.time()
        assert step.sampled is not None
        lps = step.sampled.logprobs.host() if step.sampled.logprobs is not None else {}
        plan = step.plan
        for k, (i, index) in enumerate(zip(step.rows, step.indices, strict=True)):
            req = plan.reqs[i]
            if k in lps and req.finish is None:
                req.out_logprobs[index] = lps[k]
            req.land(index, tokens[k])
            if req.hops is not None:  # (the checks before these calls skip two per request)
                stamp_first_on_host(req, on_host)
            if req.grammar is not None:
                error = lifecycle.after_token(req, index)
                if error is not None:
                    out.failed(req, error)
        live = set(self.policy.live)
        self.policy.after_step(plan)
        self.stats.generated_tokens += len(tokens)
        out.touched(plan.reqs)
        for r in plan.reqs:
            if r.finish is not None and r.rid in live:
                out.finished(r)

    @staticmethod
    def _tokens_on_host(step: InFlight) -> list[int]:
        """Block until the step's tokens are on the host (the benchmarks time this)."""
        assert step.sampled is not None, "landing an unsampled step"
        return step.sampled.wait()

    def _can_overlap(self) -> bool:
        """Launch the next step before the in-flight one's tokens are known, unless the next
        plan might need them on the host. Prompt chunks and admissions do not: a request whose
        last chunk is in flight gets its sampled token on the device, and the policy's lists
        trail the device by that one step (a request finishing in flight wastes one token).
        Retraction does (it keeps every token), so there must be room for two decode steps."""
        p = self.policy
        return (
            self.overlap
            and self.inflight is not None
            and p.mem.available() >= 2 * (p.decode_need() + len(p.prefilling))
            # Penalties need the last token's value on the host.
            and not any(needs_history(r.sampling) for r in (*p.running, *p.prefilling))
        )

    def _result(self, out: Outputs, launched: InFlight | None) -> StepResult:
        ending = out.ending()
        self.stats.finished(ending)
        traced = finished_timelines(ending) if self.trace_requests else []
        result = StepResult(out.collect(self.name, self.step_no), traced=traced)
        if launched is not None:
            result.forward_tokens = sum(launched.plan.extend_lens)
            result.is_decode = launched.plan.is_decode
            result.phase = step_phase(launched.plan.is_decode, launched.forward.as_rows)
        # Counted here, where the queue is not changing, for the heartbeat thread to read.
        self.waiting_tokens = sum(len(r.input_ids) for r in self.policy.waiting)
        if self.check_integrity and self.inflight is None:
            self.policy.check_integrity()
        return result

    # -- messages ----------------------------------------------------------------------------
    def _take_inbox(self, out: Outputs) -> None:
        while True:
            try:
                msg, submitted = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, TokenizedRequest):
                self._add(msg, submitted, out)
            elif isinstance(msg, AbortRequest):
                aborted = self.policy.find(msg.rid)
                if aborted is not None and aborted.finish is None:
                    self._end(aborted, out, msg.reason)
            elif isinstance(msg, FlushCache):
                self.flush_cache()
            elif isinstance(msg, AbortEverything):
                ended = [r for r in self.policy.all_reqs() if r.finish is None]
                log.warning("%s: ending %d request(s)", msg.reason, len(ended))
                for req in ended:
                    self._end(req, out, "bus_restart")

    def _add(self, msg: TokenizedRequest, submitted: float, out: Outputs) -> None:
        if self.policy.find(msg.trace.rid) is not None:
            return  # redelivered
        self._seq += 1
        req = admit(msg, self._seq, submitted, self.limits, self.grammars)
        if isinstance(req, ErrorInfo):
            out.failed_message(msg.detok_stream, RequestFailed(rid=msg.trace.rid, error=req))
        elif req.finish is not None:
            out.finished(req)  # the grammar forced the whole output: done without a pass
        else:
            self.policy.add(req)
        if self.trace_requests and msg.trace.traceparent and isinstance(req, Req):
            req.timeline = Timeline(msg.trace.traceparent, submitted)

    def _end(self, req: Req, out: Outputs, reason: str) -> None:
        self.aborted += 1
        self.stats.aborts[reason] += 1
        req.finish = "abort"
        self.policy.remove(req)
        out.finished(req)

    def _expire(self, out: Outputs) -> None:
        now = time.time()
        for req in self.policy.all_reqs():
            if req.deadline < now:
                self._end(req, out, "deadline")

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while any request is queued or running,
        since running requests hold locks on cached prefixes."""
        if self.policy.has_work():
            log.warning("cache flush refused: %d requests in the executor", len(self.policy.live))
            return False
        self.policy.mem.cache.reset()
        log.info("cache flushed")
        return True
