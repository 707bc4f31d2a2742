"""What a step sends: one StepOutput per detokenizer stream with every request's new tokens
(and logprobs, and its first-token timings once), and the failures of the step.

    out = Outputs()
    out.touched(plan.reqs); out.finished(req); out.failed(req, error)   # during the step
    result = out.collect(executor, step_no)                              # at its end
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from services.executor.engine.timeline import Finished
from services.executor.request import Req
from services.executor.sampling.logprobs import block, prompt_block
from services.executor.sampling.pooling import pooled_bytes
from shared.hops import stamp_hops
from shared.messages.common import ErrorInfo
from shared.messages.detok import RequestFailed, StepOutput, TokenDelta

Output = tuple[str, StepOutput | RequestFailed]


@dataclass
class StepResult:
    outputs: list[Output] = field(default_factory=list)
    forward_tokens: int = 0
    is_decode: bool = False  # the step was a DECODE (else an EXTEND, or no forward at all)
    phase: str = ""  # engine/stats.PHASES, or "" where the step launched no forward
    traced: list[Finished] = field(default_factory=list)  # tracing: the requests it finished


class Outputs:
    """The requests a step touched, finished and failed, until `collect`."""

    def __init__(self) -> None:
        self._touched: list[Req] = []
        self._finished: list[Req] = []
        self._failures: list[Output] = []

    def touched(self, reqs: Iterable[Req]) -> None:
        self._touched.extend(reqs)

    def finished(self, req: Req) -> None:
        self._finished.append(req)

    def failed(self, req: Req, error: ErrorInfo) -> None:
        self._failures.append((req.detok_stream, RequestFailed(rid=req.rid, error=error)))

    def failed_message(self, stream: str, failure: RequestFailed) -> None:
        self._failures.append((stream, failure))

    def ending(self) -> list[Req]:
        """The finished requests whose final answer `collect` will send (each once: a request
        may be finished twice in a step, or again by a step in flight after it was sent)."""
        unique = {r.rid: r for r in self._finished if not r.finish_sent}
        return list(unique.values())

    def collect(self, executor: str, step_no: int) -> list[Output]:
        """The failures, then one StepOutput per detokenizer stream."""
        by_stream: dict[str, list[TokenDelta]] = defaultdict(list)
        seen: set[str] = set()
        for req in (*self._touched, *self._finished):
            if req.rid in seen or req.finish_sent:
                continue  # a finished request may be touched again by a step in flight
            seen.add(req.rid)
            delta = token_delta(req)
            if delta is not None:
                by_stream[req.detok_stream].append(delta)
        out = self._failures + [
            (stream, StepOutput(executor=executor, step=step_no, deltas=deltas))
            for stream, deltas in by_stream.items()
        ]
        self._touched, self._finished, self._failures = [], [], []
        return out


def token_delta(req: Req) -> TokenDelta | None:
    """The request's tokens not sent yet, with their logprobs; None when there is nothing
    to send. Marks them sent."""
    upto = len(req.output_ids)
    new = req.output_ids[req.sent : upto]
    if not new and req.finish is None:
        return None
    lp = prompt_lp = None
    if req.sampling.return_logprob:
        lp = block(req.sent, new, [req.out_logprobs.pop(i, None) for i in range(req.sent, upto)])
    if req.sampling.logprob_start_len >= 0 and not req.prompt_logprobs_sent:
        prompt_lp = prompt_block(req)
        req.prompt_logprobs_sent = True
        req.prompt_logprobs.clear()
    req.sent = upto
    req.finish_sent = req.finish is not None
    delta = TokenDelta(
        rid=req.rid,
        token_ids=new,
        finish=req.finish,
        cached_tokens=req.cached_tokens,
        matched_stop_token=req.matched_stop_token,
        logprobs=lp,
        prompt_logprobs=prompt_lp,
        hops=req.hops,
        embedding=pooled_bytes(req) if req.finish is not None else None,
    )
    req.hops = None  # on the first delta only
    return delta


def stamp_first_launched(reqs: Iterable[Req], at: float) -> None:
    """A request samples its first token (after any text a grammar forced at the start,
    which is not sampled) in the step that ends its prompt."""
    for req in reqs:
        if req.hops is not None and not req.hops.first_launched:
            req.hops = stamp_hops(req.hops, first_launched=at)


def stamp_first_on_host(req: Req, at: float) -> None:
    if req.hops is not None and not req.hops.first_on_host:
        req.hops = stamp_hops(req.hops, first_on_host=at)
        if req.timeline is not None:
            req.timeline.first_token = at


def stamp_published(outputs: list[Output], now: float | None = None) -> list[Output]:
    """The outputs with `published` set on each StepOutput that carries a request's first
    token (HopTimes), as the sender publishes them; the others go unchanged."""
    now = time.time() if now is None else now
    return [
        (
            s,
            msgspec.structs.replace(m, published=now)
            if isinstance(m, StepOutput) and any(d.hops is not None for d in m.deltas)
            else m,
        )
        for s, m in outputs
    ]
