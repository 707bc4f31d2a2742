"""Runs one planned step through the model: builds the ForwardBatch, samples the next tokens."""

from __future__ import annotations

from typing import Any

import torch

from services.executor.batch_policy import StepPlan
from services.executor.cuda_graph import CudaGraphRunner
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.sampler import SamplingTensors, sample


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
    ) -> None:
        self.model = model
        self.kv = kv_pool
        self.rows = req_pool
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.graphs = graphs

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefix_lens: list[int] = []
        for req, n in zip(plan.reqs, plan.extend_lens, strict=True):
            start = req.kv_len - n  # the slots for these n tokens are already allocated
            ids += req.token_range(start, start + n)
            positions += range(start, start + n)
            slots += req.slots[start:]
            prefix_lens.append(start)
        dev = self.device
        return ForwardBatch(
            mode=ForwardMode.DECODE if plan.is_decode else ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            out_cache_loc=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            req_rows=torch.tensor([r.row for r in plan.reqs], dtype=torch.int64).to(dev),
            seq_lens=torch.tensor([r.kv_len for r in plan.reqs], dtype=torch.int64).to(
                dev, non_blocking=True
            ),
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=list(plan.extend_lens),
            kv_pool=self.kv,
            req_to_token=self.rows,
        )

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[int | None]:
        """Forward the step; the sampled token of each request, None for unfinished chunks."""
        batch = self.build_batch(plan)
        if self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.replay(batch)
        else:
            logits = self.model(batch)  # [bs, vocab]
        todo = [i for i in range(len(plan.reqs)) if plan.samples(i)]
        out: list[int | None] = [None] * len(plan.reqs)
        if not todo:
            return out
        idx = torch.tensor(todo, dtype=torch.int64, device=logits.device)
        picked = logits.index_select(0, idx).float()[:, : self.vocab_size]
        st = SamplingTensors.build(
            [plan.reqs[i].sampling for i in todo], picked.shape[-1], picked.device
        )
        gens = [plan.reqs[i].generator(self.device) for i in todo]
        tokens = sample(picked, st, self.generator, gens).tolist()
        for i, t in zip(todo, tokens, strict=True):
            out[i] = int(t)
        return out
