"""The executor's synchronous core: requests in, one batch step at a time, token deltas out.

Thread-safety: `submit` may be called from the event loop thread while `step` runs in a
worker thread; submissions go through a queue that `step` drains at its start, so the batch
state is only ever touched by the stepping thread.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

from services.executor import constrained
from services.executor.batch_policy import BatchPolicy
from services.executor.grammar import GrammarBackend
from services.executor.grammar_cache import GrammarCacheStats
from services.executor.logits_process import needs_history
from services.executor.logprobs import block, prompt_block
from services.executor.model_runner import Launched, ModelRunner
from services.executor.request import Req
from shared.hops import stamp_hops
from shared.messages.common import AbortRequest, ErrorInfo
from shared.messages.detok import RequestFailed, StepOutput, TokenDelta
from shared.messages.heartbeat import ExecutorLoad
from shared.messages.schedule import ExecutorMessage, FlushCache, TokenizedRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AbortEverything:
    """Submitted by the executor itself, never sent on the bus: end every request it holds.
    Redis restarted empty, so nobody waits for their answers any more (the gateways failed
    them); their KV slots are freed at once."""

    reason: str


@dataclass
class StepResult:
    outputs: list[tuple[str, StepOutput | RequestFailed]] = field(default_factory=list)
    forward_tokens: int = 0
    is_decode: bool = False  # the step was a DECODE (else an EXTEND, or no forward at all)


def stamp_published(
    outputs: list[tuple[str, StepOutput | RequestFailed]], now: float
) -> list[tuple[str, StepOutput | RequestFailed]]:
    """The outputs with `published` set on each StepOutput that carries a request's first
    token (HopTimes), as the sender publishes them; the others go unchanged."""
    return [
        (
            s,
            msgspec.structs.replace(m, published=now)
            if isinstance(m, StepOutput) and any(d.hops is not None for d in m.deltas)
            else m,
        )
        for s, m in outputs
    ]


class Engine:
    def __init__(
        self,
        name: str,
        stream: str,
        model_name: str,
        context_length: int,
        policy: BatchPolicy,
        runner: ModelRunner,
        check_integrity: bool = False,
        overlap: bool | None = None,
    ) -> None:
        self.name, self.stream, self.model_name = name, stream, model_name
        self.context_length = context_length
        self.policy = policy
        self.runner = runner
        # (message, when it was submitted): the submit time is the request's executor_inbox
        self.inbox: queue.SimpleQueue[tuple[ExecutorMessage | AbortEverything, float]] = (
            queue.SimpleQueue()
        )
        self.reqs: dict[str, Req] = {}
        self.step_no = 0
        self._seq = 0
        self.check_integrity = check_integrity
        # Overlap needs an asynchronous device; on the CPU it only adds bookkeeping.
        self.overlap = runner.cuda if overlap is None else overlap
        self.inflight: Launched | None = None
        self._touched: list[Req] = []  # requests that got tokens since the last collect
        self.overlapped_steps = 0  # steps launched before the previous one's tokens landed
        self._failures: list[tuple[str, StepOutput | RequestFailed]] = []
        self.grammars: GrammarBackend | None = None  # set when the executor serves grammars
        self.grammar_cache_stats: GrammarCacheStats | None = None
        self.waiting_tokens = 0  # prompt tokens of the waiting requests, as of the last step

    # -- called from any thread --------------------------------------------------------------
    def submit(self, msg: ExecutorMessage | AbortEverything) -> None:
        self.inbox.put((msg, time.time()))

    def load(self) -> ExecutorLoad:
        p = self.policy
        return ExecutorLoad(
            stream=self.stream,
            model=self.model_name,
            context_length=self.context_length,
            waiting=len(p.waiting) + self.inbox.qsize(),
            running=len(p.prefilling) + len(p.running),
            free_kv_tokens=p.kv.num_free(),
            total_kv_tokens=p.kv.num_slots,
            cached_tokens=p.mem.cache.total_size(),
            evictable_tokens=p.mem.cache.evictable_size(),
            max_running=p.max_running,
            grammar_requests=self.grammars.stats.requests if self.grammars else 0,
            grammar_cache_hits=self.grammar_cache_stats.hits if self.grammar_cache_stats else 0,
            grammar_fetched=self.grammar_cache_stats.fetched if self.grammar_cache_stats else 0,
            grammar_load_s=self.grammar_cache_stats.load_s if self.grammar_cache_stats else 0.0,
            jump_forward_tokens=self.grammars.stats.jump_forward_tokens if self.grammars else 0,
            jump_extended_tokens=p.jump_extended_tokens,
            waiting_tokens=self.waiting_tokens,
        )

    # -- the stepping thread -----------------------------------------------------------------
    def has_work(self) -> bool:
        return self.policy.has_work() or not self.inbox.empty() or self.inflight is not None

    def step(self) -> StepResult:
        """Plan and launch the next step; finish the previous one. With overlap, the device
        computes step N+1 while the host turns step N's tokens into outputs."""
        result = StepResult()
        finished: list[Req] = []
        self._drain_inbox(result, finished)
        self._expire(finished)
        if self.inflight is not None and not self._can_overlap():
            self._finish(self.inflight, finished)
            self.inflight = None
        plan = self.policy.plan()
        launched = None
        if plan is not None:
            # A grammar's mask needs the in-flight step's tokens: sample after they land,
            # while this step's forward pass runs.
            defer = self.inflight is not None and any(r.grammar is not None for r in plan.reqs)
            started = time.time()
            launched = self.runner.launch(plan, prev=self.inflight, sample=not defer)
            self.overlapped_steps += self.inflight is not None
            launched.indices = [plan.reqs[i].add_pending() for i in launched.rows]
            # A request samples its first token (after any text a grammar forced at the
            # start, which is not sampled) in the step that ends its prompt: never a DECODE,
            # whose requests all sampled before. Decode steps skip this loop.
            if not plan.is_decode:
                for i in launched.rows:
                    req = plan.reqs[i]
                    if req.hops is not None and not req.hops.first_launched:
                        req.hops = stamp_hops(req.hops, first_launched=started)
            result.forward_tokens = sum(plan.extend_lens)
            result.is_decode = plan.is_decode
            self.step_no += 1
        if self.inflight is not None:
            self._finish(self.inflight, finished)
        if launched is not None and launched.logits is not None and launched.rows:
            self.runner.sample(launched)
        self.inflight = launched
        if launched is not None and not self.overlap:
            self._finish(launched, finished)
            self.inflight = None
        result.outputs += self._failures
        self._failures.clear()
        result.outputs += self._collect(finished)
        for req in finished:
            self.reqs.pop(req.rid, None)
        # Counted here, where the queue is not changing, for the heartbeat thread to read.
        self.waiting_tokens = sum(len(r.input_ids) for r in self.policy.waiting)
        if self.check_integrity and self.inflight is None:
            self.policy.check_integrity()
        return result

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

    def _finish(self, launched: Launched, finished: list[Req]) -> None:
        """The step's tokens reached the host: record them, retire finished requests."""
        tokens = self.runner.wait(launched)
        on_host = time.time()
        plan = launched.plan
        lps = launched.logprobs.host() if launched.logprobs is not None else {}
        for k, (i, index) in enumerate(zip(launched.rows, launched.indices, strict=True)):
            tok = tokens[i]
            assert tok is not None
            req = plan.reqs[i]
            if k in lps and req.finish is None:
                req.out_logprobs[index] = lps[k]
            req.resolve(index, tok)
            if req.hops is not None and not req.hops.first_on_host:
                req.hops = stamp_hops(req.hops, first_on_host=on_host)
            error = constrained.after_token(req, index)
            if error is not None:
                self._failures.append((req.detok_stream, RequestFailed(rid=req.rid, error=error)))
        self.policy.after_step(plan)
        self._touched.extend(plan.reqs)
        finished += [r for r in plan.reqs if r.finish is not None and r.rid in self.reqs]

    def _drain_inbox(self, result: StepResult, finished: list[Req]) -> None:
        while True:
            try:
                msg, submitted = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, TokenizedRequest):
                failed = self._add(msg, submitted)
                if failed is not None:
                    result.outputs.append((msg.detok_stream, failed))
                elif self.reqs[msg.trace.rid].finish is not None:
                    # The grammar forced the whole output: done without a forward pass.
                    finished.append(self.reqs[msg.trace.rid])
            elif isinstance(msg, AbortRequest):
                aborted = self.reqs.get(msg.rid)
                if aborted is not None and aborted.finish is None:
                    aborted.finish = "abort"
                    self.policy.remove(aborted)
                    finished.append(aborted)
            elif isinstance(msg, FlushCache):
                self.flush_cache()
            elif isinstance(msg, AbortEverything):
                ended = [r for r in self.reqs.values() if r.finish is None]
                log.warning("%s: ending %d request(s)", msg.reason, len(ended))
                for req in ended:
                    req.finish = "abort"
                    self.policy.remove(req)
                    finished.append(req)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while any request is queued or running,
        since running requests hold locks on cached prefixes."""
        if self.policy.has_work():
            log.warning("cache flush refused: %d requests in the executor", len(self.reqs))
            return False
        self.policy.mem.cache.reset()
        log.info("cache flushed")
        return True

    def _add(self, msg: TokenizedRequest, submitted: float) -> RequestFailed | None:
        rid = msg.trace.rid
        if rid in self.reqs:
            return None  # redelivered
        need = len(msg.input_ids) + msg.max_new_tokens
        if need > self.policy.kv.num_slots:
            err = ErrorInfo(
                status=400,
                message=(
                    f"the prompt ({len(msg.input_ids)} tokens) plus max_tokens "
                    f"({msg.max_new_tokens}) needs {need} KV slots; this executor has "
                    f"{self.policy.kv.num_slots}"
                ),
                param="max_tokens",
            )
            return RequestFailed(rid=rid, error=err)
        vocab = self.runner.vocab_size
        # The tokenizer checks ids against its own vocabulary; a model whose embedding is
        # smaller would index out of range and take the whole batch down with it.
        ids = msg.input_ids
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # min/max: C loops, on every request
            bad = next(t for t in ids if not 0 <= t < vocab)
            err = ErrorInfo(
                status=400,
                message=f"input_ids holds token id {bad}, outside this model's vocabulary "
                f"[0, {vocab})",
                param="input_ids",
            )
            return RequestFailed(rid=rid, error=err)
        self._seq += 1
        req = Req.from_message(msg, self._seq, self.context_length)
        req.hops = stamp_hops(req.hops, executor_inbox=submitted)
        if req.exhausted:  # resumed with its whole output: only the ending is left to send
            req.finish = "length"
        if msg.grammar_key:
            if self.grammars is None:
                err = ErrorInfo(
                    status=500, message="this executor serves no grammars", type="server_error"
                )
                return RequestFailed(rid=rid, error=err)
            try:
                req.grammar = self.grammars.new_request(msg.grammar_key, msg.eos_token_ids)
            except KeyError:
                err = ErrorInfo(
                    status=503,
                    message="the request's grammar is not loaded; retry",
                    type="server_error",
                )
                return RequestFailed(rid=rid, error=err)
            except Exception as e:  # the matcher refused to start: this request fails, alone
                err = ErrorInfo(
                    status=500,
                    message=f"structured output failed: cannot start the grammar matcher: "
                    f"{type(e).__name__}: {e}",
                    type="server_error",
                )
                return RequestFailed(rid=rid, error=err)
            try:
                constrained.start(req) if not msg.resume_ids else constrained.resume(req)
            except Exception as e:
                err = ErrorInfo(
                    status=500,
                    message=f"structured output failed: {type(e).__name__}: {e}",
                    type="server_error",
                )
                return RequestFailed(rid=rid, error=err)
        self.reqs[rid] = req
        if req.finish is None:
            self.policy.add(req)
        return None

    def _expire(self, finished: list[Req]) -> None:
        now = time.time()
        for req in self.policy.all_reqs():
            if req.deadline < now:
                req.finish = "abort"
                self.policy.remove(req)
                finished.append(req)

    def _collect(self, finished: list[Req]) -> list[tuple[str, StepOutput | RequestFailed]]:
        """One StepOutput per detokenizer stream with every request's new tokens."""
        by_stream: dict[str, list[TokenDelta]] = defaultdict(list)
        seen: set[str] = set()
        for req in (*self._touched, *finished):
            if req.rid in seen or req.finish_sent:
                continue  # a finished request may be touched again by a step in flight
            seen.add(req.rid)
            upto = req.resolved_len
            new = req.output_ids[req.sent : upto]
            if not new and req.finish is None:
                continue
            lp = prompt_lp = None
            if req.sampling.return_logprob:
                lp = block(
                    req.sent, new, [req.out_logprobs.pop(i, None) for i in range(req.sent, upto)]
                )
            if req.sampling.logprob_start_len >= 0 and not req.prompt_logprobs_sent:
                prompt_lp = prompt_block(req)
                req.prompt_logprobs_sent = True
                req.prompt_logprobs.clear()
            req.sent = upto
            req.finish_sent = req.finish is not None
            by_stream[req.detok_stream].append(
                TokenDelta(
                    rid=req.rid,
                    token_ids=new,
                    finish=req.finish,
                    cached_tokens=req.cached_tokens,
                    matched_stop_token=req.matched_stop_token,
                    logprobs=lp,
                    prompt_logprobs=prompt_lp,
                    hops=req.hops,
                )
            )
            req.hops = None  # on the first delta only
        self._touched.clear()
        return [
            (stream, StepOutput(executor=self.name, step=self.step_no, deltas=deltas))
            for stream, deltas in by_stream.items()
        ]
