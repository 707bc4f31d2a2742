"""When a request passed each point in the executor, for its trace spans (--otlp-traces-
endpoint): kept only while tracing is on, as plain floats on the stepping thread, and turned
into spans by the async shell once the request finished (services/executor/tracing.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.executor.request import Req


@dataclass
class Timeline:
    traceparent: str  # the gateway's span of the request: the parent of the executor's
    inbox: float  # unix seconds: the reader handed it to the engine
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (launched, prompt tokens)
    first_token: float = 0.0  # its first sampled token reached the host
    finished: float = 0.0
    retractions: int = 0


@dataclass(frozen=True)
class Finished:
    """A finished request's timeline and what its spans report."""

    rid: str
    timeline: Timeline
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish: str


def record_chunks(reqs: list[Req], extend_lens: list[int], launched: float) -> None:
    """An extend step was launched: each traced request's prompt chunk in it (extends after
    the first token, of text a grammar forced or of a retracted request's recompute, are part
    of its decode)."""
    for req, n in zip(reqs, extend_lens, strict=True):
        if req.timeline is not None and not req.timeline.first_token:
            req.timeline.chunks.append((launched, n))


def finished_timelines(ending: Iterable[Req]) -> list[Finished]:
    """The traced requests among those a step ends (Outputs.ending: each once)."""
    now = time.time()
    out = []
    for r in ending:
        if r.timeline is not None:
            r.timeline.finished = now
            out.append(
                Finished(
                    r.rid,
                    r.timeline,
                    len(r.input_ids),
                    r.cached_tokens,
                    len(r.output_ids),
                    r.finish or "",
                )
            )
    return out
