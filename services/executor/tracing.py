"""The executor's spans of a finished request, from its Timeline (engine/timeline.py):

    executor            inbox -> finished   (prompt, cached and completion tokens, finish)
      queue             inbox -> its first prompt chunk was launched
      prefill           first chunk launched -> its first token reached the host
        prefill_chunk   one per chunk: launched -> the next chunk's launch (or first token)
      decode            first token -> finished

Recorded by the async shell after the step that finished the request, never per token.
"""

from __future__ import annotations

from services.executor.engine.timeline import Finished
from shared.tracing import Tracing


def record_request(tracing: Tracing, f: Finished) -> None:
    tl = f.timeline
    parent = tracing.record(
        "executor",
        tl.traceparent,
        tl.inbox,
        tl.finished,
        {
            "rid": f.rid,
            "prompt_tokens": f.prompt_tokens,
            "cached_tokens": f.cached_tokens,
            "completion_tokens": f.completion_tokens,
            "finish_reason": f.finish,
            "prefill_chunks": len(tl.chunks),
        },
    )
    first_launch = tl.chunks[0][0] if tl.chunks else tl.finished
    tracing.record("queue", parent, tl.inbox, first_launch, {"rid": f.rid})
    if not tl.chunks:
        return  # ended (aborted, expired) before its prompt ran
    prefill_end = tl.first_token or tl.finished
    prefill = tracing.record(
        "prefill",
        parent,
        first_launch,
        prefill_end,
        {"rid": f.rid, "prompt_tokens": f.prompt_tokens, "cached_tokens": f.cached_tokens},
    )
    ends = [launched for launched, _ in tl.chunks[1:]] + [prefill_end]
    for (launched, tokens), end in zip(tl.chunks, ends, strict=True):
        tracing.record("prefill_chunk", prefill, launched, end, {"tokens": tokens})
    if tl.first_token:
        tracing.record(
            "decode",
            parent,
            tl.first_token,
            tl.finished,
            {"rid": f.rid, "completion_tokens": f.completion_tokens},
        )
