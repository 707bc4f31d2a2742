"""Compile every kernel variant before the first request, so no client waits on the compiler.

Triton compiles a kernel the first time it sees a new specialisation of its arguments:
integers are specialised on being 1 and on being a multiple of 16, so a prefill of 16 tokens
and one of 17 run different binaries. Each compile takes a few hundred milliseconds, which
a first request, or the first batch of a benchmark, would otherwise pay on its first token.
CUDA-graph capture already compiled the decode kernels; this runs prefills of the token and
batch counts that cover the other specialisations, samples with and without filters, applies
a grammar mask, and then empties the prefix cache of what it computed.
"""

from __future__ import annotations

import logging
import time

import torch

from services.executor.engine.loop import Engine
from shared.messages.common import SamplingParams, Trace
from shared.messages.detok import RequestFailed
from shared.messages.schedule import TokenizedRequest

log = logging.getLogger(__name__)

# (prompt lengths of one batch): 1, 16 and 17 tokens alone and together, a batch of 16, and
# a prompt past 64 tokens (extend attention's larger query tiles)
WARMUP_BATCHES: tuple[tuple[int, ...], ...] = (
    (1,),
    (16,),
    (17,),
    (1, 16, 17),
    (32,) * 16,
    (80,),
)


def _request(rid: str, seed: int, length: int, vocab: int, sampled: bool) -> TokenizedRequest:
    # Distinct prompts: shared prefixes would be computed once and reused from the cache.
    ids = [(7919 * seed + 31 * i) % max(vocab - 1, 1) + 1 for i in range(length)]
    sampling = (
        SamplingParams(max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=20, ignore_eos=True)
        if sampled
        else SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    )
    return TokenizedRequest(
        trace=Trace(rid=rid, reply_to="", deadline=time.time() + 600),
        input_ids=ids,
        sampling=sampling,
        max_new_tokens=2,
        eos_token_ids=[],
        detok_stream="",
    )


def warm_up(engine: Engine) -> None:
    """Run the warm-up batches to completion; raise if any of them fails.

    They run as extends: on a GPU an extend of up to 256 tokens would replay the decode
    graphs (extend_rows.py), which the capture compiled, and leave the extend kernels, which
    longer prompts still take, to the first such request (about a second on an H200)."""
    started = time.perf_counter()
    vocab = engine.runner.vocab_size
    rows_max, engine.runner.rows_max = engine.runner.rows_max, 0
    try:
        seed = 0
        for b, lengths in enumerate(WARMUP_BATCHES):
            for i, n in enumerate(lengths):
                seed += 1
                engine.submit(_request(f"warmup-{b}-{i}", seed, n, vocab, sampled=i % 2 == 1))
            while engine.has_work():
                for _, msg in engine.step().outputs:
                    if isinstance(msg, RequestFailed):
                        raise RuntimeError(f"warm-up request failed: {msg.error.message}")
    finally:
        engine.runner.rows_max = rows_max
    engine.flush_cache()
    warm_masks(engine.runner.vocab_size, engine.runner.device)
    log.info("kernels warmed up in %.1f s", time.perf_counter() - started)


def warm_masks(vocab: int, device: torch.device) -> torch.Tensor:
    """The grammar-mask kernel, as sampling a constrained request launches it (float32 rows
    of the model's whole vocabulary): otherwise the first constrained batch compiles it.
    Returns the two rows it masked (row 0 masked everywhere, row 1 untouched)."""
    from services.executor.grammar.masks import apply_bitmask  # imports xgrammar

    logits = torch.zeros(2, vocab, dtype=torch.float32, device=device)
    bitmask = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    apply_bitmask(logits, bitmask, [0])
    # Row 0 masked everywhere, row 1 untouched: a kernel that ran on the wrong rows would
    # hide here until a client's constrained request.
    if not (torch.isinf(logits[0]).all() and not logits[1].any()):
        raise RuntimeError("the grammar-mask kernel failed its warm-up check")
    return logits
