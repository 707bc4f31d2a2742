"""Runs one planned step through the model: builds the ForwardBatch, samples the next tokens.

`launch` queues the step on the device and returns at once; `wait` blocks until its tokens
are on the host. Between the two the engine does the CPU work of the previous step, so on a
GPU the host's bookkeeping overlaps the device's forward pass. A decode step may be launched
before the previous step's tokens reached the host: its input tokens are then read on the
device from that step's sampled tensor (`PENDING` marks them on the host).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from services.executor.batch_policy import StepPlan
from services.executor.cuda_graph import CudaGraphRunner
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.logits_process import LogitsProcessor
from services.executor.logprobs import PromptLogprobTargets, SampledLogprobs
from services.executor.packing import pack_aligned, to_device
from services.executor.request import PENDING
from services.executor.sampler import SamplingTensors, sample


@dataclass
class Launched:
    """A step queued on the device."""

    plan: StepPlan
    rows: list[int]  # plan indices of the requests that sample this step
    tokens: torch.Tensor  # [len(rows)] int64 on the device
    host: torch.Tensor  # [len(rows)] int64, filled by an async copy
    done: torch.cuda.Event | None  # None on the CPU, where everything is synchronous
    indices: list[int] = field(default_factory=list)  # output index each sampled token fills
    logprobs: SampledLogprobs | None = None  # of the rows that asked (indices into `rows`)
    logits: torch.Tensor | None = None  # until the step is sampled


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        graphs: CudaGraphRunner | None = None,
        sample_vocab: int = 0,
    ) -> None:
        self.model = model
        self.kv = kv_pool
        self.rows = req_pool
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.graphs = graphs
        self.cuda = device.type == "cuda"
        # Ids past the tokenizer's vocabulary are padding rows of the embedding: never sample
        # them (they would decode to nothing).
        self.sample_vocab = min(vocab_size, sample_vocab) if sample_vocab > 0 else vocab_size
        self.bitmask: torch.Tensor | None = None  # [max_bs, words] int32 on the host

    def build_batch(self, plan: StepPlan, prev: Launched | None = None) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefix_lens: list[int] = []
        pending: list[int] = []  # token index -> row in prev.tokens, for PENDING inputs
        pending_at: list[int] = []
        prev_row = {id(prev.plan.reqs[i]): k for k, i in enumerate(prev.rows)} if prev else {}
        for req, n in zip(plan.reqs, plan.extend_lens, strict=True):
            start = req.kv_len - n  # the slots for these n tokens are already allocated
            chunk = req.token_range(start, start + n)
            if chunk and chunk[-1] == PENDING:  # only the last token can still be in flight
                pending_at.append(len(ids) + n - 1)
                pending.append(prev_row[id(req)])
            ids += chunk
            positions += range(start, start + n)
            slots += req.slots[start:]
            prefix_lens.append(start)
        # One host-to-device copy for every integer input of the step, each table aligned so
        # that the kernels reading them compile once (see packing.py).
        last = list(itertools.accumulate(plan.extend_lens, initial=-1))[1:]
        input_ids, positions_t, out_cache_loc, req_rows, seq_lens, last_t = pack_aligned(
            [
                ids,
                positions,
                slots,
                [r.row for r in plan.reqs],
                [r.kv_len for r in plan.reqs],
                last,
            ],
            torch.int64,
            self.device,
        )
        if pending:
            assert prev is not None
            at, src = pack_aligned([pending_at, pending], torch.int64, self.device)
            input_ids = input_ids.clone()
            input_ids[at] = prev.tokens[src]
        return ForwardBatch(
            mode=ForwardMode.DECODE if plan.is_decode else ForwardMode.EXTEND,
            input_ids=input_ids,
            positions=positions_t,
            out_cache_loc=out_cache_loc,
            req_rows=req_rows,
            seq_lens=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=list(plan.extend_lens),
            kv_pool=self.kv,
            req_to_token=self.rows,
            last_indices=last_t,
        )

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: Launched | None = None, sample: bool = True) -> Launched:
        """Queue the step's forward pass and, unless `sample` is False, its sampling; nothing
        waits for the device. Deferred sampling (`sample(launched)` later) lets the host learn
        the previous step's tokens, and fill grammar masks from them, while this step's
        forward pass runs."""
        self.rows.flush()  # the slots planning allocated, for the kernels to read
        batch = self.build_batch(plan, prev)
        prompt_lp = (
            None if plan.is_decode else PromptLogprobTargets.build(plan.reqs, plan.extend_lens)
        )
        if prompt_lp is not None:
            batch.extra_indices = to_device(prompt_lp.positions, torch.int64, self.device)
        if self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.replay(batch)
        else:
            logits = self.model(batch)  # [bs, vocab]
        if prompt_lp is not None:
            assert batch.extra_hidden is not None
            prompt_lp.compute(batch.extra_hidden, self.model.lm_head)
        rows = [i for i in range(len(plan.reqs)) if plan.samples(i)]
        empty = torch.empty(0, dtype=torch.int64)
        launched = Launched(plan, rows, empty.to(self.device), empty, None, logits=logits)
        if rows and sample:
            self.sample(launched)
        return launched

    @torch.inference_mode()
    def sample(self, launched: Launched) -> None:
        """Queue the sampling of a launched step: masks, processors, the draw, logprobs."""
        plan, rows, logits = launched.plan, launched.rows, launched.logits
        assert logits is not None, "sampled twice"
        launched.logits = None
        if len(rows) == len(plan.reqs):
            picked = logits[:, : self.sample_vocab]
        else:
            idx = to_device(rows, torch.int64, self.device)
            picked = logits.index_select(0, idx)[:, : self.sample_vocab]
        reqs = [plan.reqs[i] for i in rows]
        # Raw logprobs are taken before masks and penalties change the logits in place.
        want_lp = SampledLogprobs.want(reqs)
        raw_lp = None
        if want_lp:
            at = to_device(want_lp, torch.int64, self.device)
            raw_lp = torch.log_softmax(picked.index_select(0, at).float(), dim=-1)
        # A request that finished while this step was in flight samples a discarded token.
        grammars = [r.grammar if r.finish is None else None for r in reqs]
        if any(g is not None for g in grammars):
            # The forward pass is queued on the device: filling the masks on the host now
            # overlaps it. Masks are applied to the full-width logits, then cut.
            picked = self._masked(logits, rows, grammars, len(rows) == len(plan.reqs))
        picked = picked.float()
        processor = LogitsProcessor.build(reqs, picked.shape[-1], picked.device)
        if processor is not None:
            processor.apply(picked)  # in place: the logits are this step's alone
        st = SamplingTensors.build([r.sampling for r in reqs], picked.shape[-1], picked.device)
        gens = [r.generator(self.device) for r in reqs]
        tokens = sample(picked, st, self.generator, gens)
        if raw_lp is not None:
            ks = [reqs[k].sampling.top_logprobs for k in want_lp]
            launched.logprobs = SampledLogprobs.compute(raw_lp, tokens, want_lp, ks)
        launched.tokens = tokens
        if not self.cuda:
            launched.host = tokens
            return
        launched.host = torch.empty(len(rows), dtype=torch.int64, pin_memory=True)
        launched.host.copy_(tokens, non_blocking=True)
        launched.done = torch.cuda.Event()
        launched.done.record()

    def _masked(
        self, logits: torch.Tensor, rows: list[int], grammars: list[Any], all_rows: bool
    ) -> torch.Tensor:
        from services.executor.grammar_masks import apply_bitmask, fill_bitmask

        if self.bitmask is None or self.bitmask.shape[0] < len(rows):
            words = (logits.shape[-1] + 31) // 32
            self.bitmask = torch.full((max(len(rows), 64), words), -1, dtype=torch.int32)
            if self.cuda:
                self.bitmask = self.bitmask.pin_memory()
        masked_rows = fill_bitmask(grammars, self.bitmask)
        if all_rows:
            full = logits.float()
        else:
            idx = to_device(rows, torch.int64, self.device)
            full = logits.index_select(0, idx).float()
        apply_bitmask(full, self.bitmask, masked_rows)
        return full[:, : self.sample_vocab]

    def wait(self, launched: Launched) -> list[int | None]:
        """The sampled token of each request of the step, None for unfinished chunks."""
        assert launched.logits is None or not launched.rows, "waiting on an unsampled step"
        if launched.done is not None:
            launched.done.synchronize()
        out: list[int | None] = [None] * len(launched.plan.reqs)
        for i, t in zip(launched.rows, launched.host.tolist(), strict=True):
            out[i] = int(t)
        return out
