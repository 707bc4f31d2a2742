"""One step's sampling, start to end: grammar masks, logits processors, the draw, logprobs.

    sampled = sampler.sample(forward, reqs, positions)

Nothing waits for the device: the draw and the copy of its tokens to the host are queued
behind the forward pass, and `Sampled.wait()` blocks only when the engine needs the values.
"""

from __future__ import annotations

import torch

from services.executor.engine.records import Forward, Sampled, no_tokens
from services.executor.grammar.masks import BatchMasks
from services.executor.grammar.matcher import RequestGrammar
from services.executor.packing import to_device
from services.executor.sampling.logprobs import SampledLogprobs
from services.executor.sampling.processors import LogitsProcessor
from services.executor.sampling.sampler import SamplingTensors, sample


class Sampler:
    """The sampling of one executor: its random generator, the sampled vocabulary, the
    grammar masks' buffers."""

    def __init__(
        self, device: torch.device, vocab_size: int, sample_vocab: int = 0, seed: int = 0
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Ids past the tokenizer's vocabulary are padding rows of the embedding: never sample
        # them (they would decode to nothing).
        self.sample_vocab = min(vocab_size, sample_vocab) if sample_vocab > 0 else vocab_size
        self.masks = BatchMasks(pin_memory=self.cuda)

    @torch.inference_mode()
    def sample(self, forward: Forward, positions: list[int]) -> Sampled:
        """Queue the sampling of `forward`'s rows; `positions[k]`: the output index of row k's
        token (min_new_tokens counts it)."""
        rows, logits = forward.rows, forward.logits
        if not rows:
            return no_tokens(self.device)
        all_rows = len(rows) == len(forward.plan.reqs)
        if all_rows:
            picked = logits[:, : self.sample_vocab]
        else:
            idx = to_device(rows, torch.int64, self.device)
            picked = logits.index_select(0, idx)[:, : self.sample_vocab]
        reqs = [forward.plan.reqs[i] for i in rows]
        # Raw logprobs are taken before masks and penalties change the logits in place.
        want_lp = SampledLogprobs.want(reqs)
        raw_lp = None
        if want_lp:
            at = to_device(want_lp, torch.int64, self.device)
            raw_lp = torch.log_softmax(picked.index_select(0, at).float(), dim=-1)
        # A request that finished while this step was in flight samples a discarded token; a
        # grammar still waiting for the thinking part to end masks nothing.
        grammars = [
            g if (g := r.grammar) is not None and r.finish is None and not g.dormant else None
            for r in reqs
        ]
        if any(g is not None for g in grammars):
            # The forward pass is queued on the device: filling the masks on the host now
            # overlaps it. Masks are applied to the full-width logits, then cut.
            picked = self._masked(logits, rows, grammars, all_rows)
        picked = picked.float()
        processor = LogitsProcessor.build(reqs, positions, picked.shape[-1], picked.device)
        if processor is not None:
            processor.apply(picked)  # in place: the logits are this step's alone
        st = SamplingTensors.build([r.sampling for r in reqs], picked.shape[-1], picked.device)
        seeded = any(r.sampling.seed is not None for r in reqs)
        gens = [r.generator(self.device) for r in reqs] if seeded else None
        tokens = sample(picked, st, self.generator, gens)
        lps = None
        if raw_lp is not None:
            ks = [reqs[k].sampling.top_logprobs for k in want_lp]
            lps = SampledLogprobs.compute(raw_lp, tokens, want_lp, ks)
        if not self.cuda:
            return Sampled(tokens, tokens, None, lps)
        host = torch.empty(len(rows), dtype=torch.int64, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Sampled(tokens, host, done, lps)

    def _masked(
        self,
        logits: torch.Tensor,
        rows: list[int],
        grammars: list[RequestGrammar | None],
        all_rows: bool,
    ) -> torch.Tensor:
        masked_rows = self.masks.fill(grammars, logits.shape[-1])
        if all_rows:
            full = logits.float()
        else:
            idx = to_device(rows, torch.int64, self.device)
            full = logits.index_select(0, idx).float()
        self.masks.apply(full, masked_rows)
        return full[:, : self.sample_vocab]
