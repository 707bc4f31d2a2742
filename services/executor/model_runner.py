"""Runs one planned step through the model: builds the ForwardBatch, queues the forward pass.

`forward` returns as soon as the kernels are queued; the engine samples the logits (see
sampling/step.py) and does the CPU work of the previous step meanwhile, so on a GPU the host's
bookkeeping overlaps the device's forward pass. A decode step may be launched before the
previous step's tokens reached the host: its input token is then read on the device from
that step's sampled tensor (the request counts it as `pending`).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from services.executor.batch_policy import StepPlan
from services.executor.cuda_graph import CudaGraphRunner
from services.executor.engine.records import Forward, InFlight
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.packing import pack_aligned, to_device
from services.executor.sampling.logprobs import PromptLogprobTargets


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        vocab_size: int,
        device: torch.device,
        graphs: CudaGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.kv = kv_pool
        self.req_to_token = req_pool
        self.vocab_size = vocab_size
        self.device = device
        self.graphs = graphs
        self.cuda = device.type == "cuda"

    def build_batch(self, plan: StepPlan, prev: InFlight | None = None) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefix_lens: list[int] = []
        pending: list[int] = []  # token index -> row in prev's sampled tokens
        pending_at: list[int] = []
        prev_row = {id(prev.plan.reqs[i]): k for k, i in enumerate(prev.rows)} if prev else {}
        for req, n in zip(plan.reqs, plan.extend_lens, strict=True):
            start = req.kv_len - n  # the slots for these n tokens are already allocated
            end = start + n
            known = min(end, req.known_len)
            chunk = req.token_range(start, known)
            if end > known:  # its last token is still on the device (only the last can be)
                assert end == known + 1, f"{req.rid}: {end - known} input tokens unknown"
                pending_at.append(len(ids) + n - 1)
                pending.append(prev_row[id(req)])
                chunk.append(0)  # replaced on the device below
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
            assert prev is not None and prev.sampled is not None, "the previous step unsampled"
            at, src = pack_aligned([pending_at, pending], torch.int64, self.device)
            input_ids = input_ids.clone()
            input_ids[at] = prev.sampled.tokens[src]
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
            req_to_token=self.req_to_token,
            last_indices=last_t,
        )

    @torch.inference_mode()
    def forward(self, plan: StepPlan, prev: InFlight | None = None) -> Forward:
        """Queue the step's forward pass (and the prompt logprobs it carries); nothing waits
        for the device. `prev`: the step in flight, whose sampled tokens are this one's
        pending inputs."""
        self.req_to_token.flush()  # the slots planning allocated, for the kernels to read
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
        return Forward(plan, rows, logits)
