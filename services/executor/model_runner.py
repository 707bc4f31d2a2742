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

from services.executor import extend_rows
from services.executor.batch_policy import StepPlan
from services.executor.cuda_graph import CudaGraphRunner
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.steps import HostChannel, StepTables
from services.executor.engine.records import Forward, InFlight, Sampled
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.packing import pack_aligned, to_device
from services.executor.sampling.logprobs import PromptLogprobTargets
from services.executor.sampling.pooling import PoolTargets


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        vocab_size: int,
        device: torch.device,
        graphs: CudaGraphRunner | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.model = model
        self.kv = kv_pool
        self.req_to_token = req_pool
        self.vocab_size = vocab_size
        self.device = device
        self.graphs = graphs
        self.cuda = device.type == "cuda"
        self.tp = tp
        # The most new tokens an extend step runs as decode rows (extend_rows.py), within
        # the CUDA graphs' largest batch; None: extend_rows.MAX_ROWS, and none without
        # graphs (eager rows would save nothing; tests set it to run them on the CPU).
        self.rows_max: int | None = None
        # rank 0 of a tensor-parallel group sends every step's tables to the other ranks
        self.channel = HostChannel(tp.host_group) if tp.size > 1 and tp.is_leader else None
        if self.channel is not None:
            req_pool.flush_log = []

    def step_tables(self, plan: StepPlan, prev: InFlight | None = None) -> StepTables:
        """The step's integers: what every rank builds its ForwardBatch from."""
        t = StepTables(is_decode=plan.is_decode, sampling_rows=0)
        # Req hashes by identity: the request -> its row among prev's sampled tokens
        prev_row = {prev.plan.reqs[i]: k for k, i in enumerate(prev.rows)} if prev else {}
        ids, positions, slots, prefix_lens = t.ids, t.positions, t.slots, t.prefix_lens
        for req, n in zip(plan.reqs, plan.extend_lens, strict=True):
            end = len(req.slots)  # the slots for these n tokens are already allocated
            start = end - n
            prompt = len(req.input_ids)
            known = prompt + len(req.output_ids)
            if end > known:  # its last token is still on the device (only the last can be)
                assert end == known + 1, f"{req.rid}: {end - known} input tokens unknown"
                t.pending_at.append(len(ids) + n - 1)
                t.pending_src.append(prev_row[req])
            if n == 1:  # a decode token: no slices (Req.token_range, inlined)
                if end > known:
                    ids.append(0)  # replaced on the device (batch_from)
                elif start < prompt:
                    ids.append(req.input_ids[start])
                else:
                    ids.append(req.output_ids[start - prompt])
                positions.append(start)
                slots.append(req.slots[start])
            else:
                ids += req.token_range(start, min(end, known))
                if end > known:
                    ids.append(0)
                positions += range(start, end)
                slots += req.slots[start:]
            prefix_lens.append(start)
        t.rows = [r.row for r in plan.reqs]
        t.seq_lens = [len(r.slots) for r in plan.reqs]
        t.extend_lens = list(plan.extend_lens)
        t.last = list(itertools.accumulate(plan.extend_lens, initial=-1))[1:]
        return t

    def batch_from(self, t: StepTables, prev_tokens: torch.Tensor | None) -> ForwardBatch:
        """The ForwardBatch of `t`; `prev_tokens`: the previous step's sampled tokens on the
        device, where the pending inputs are read."""
        n = len(t.ids)
        rows, seq_lens, last, prefix_lens, extend_lens = (
            t.rows,
            t.seq_lens,
            t.last,
            t.prefix_lens,
            t.extend_lens,
        )
        tables = [t.ids, t.positions, t.slots]
        if t.as_rows:  # one decode row a new token, read at each request's last
            rows, seq_lens = extend_rows.as_rows(t)
            last, prefix_lens, extend_lens = list(range(n)), t.positions, [1] * n
            tables.append(t.last)
        # One host-to-device copy for every integer input of the step, each table aligned so
        # that the kernels reading them compile once (see packing.py).
        packed = pack_aligned([*tables, rows, seq_lens, last], torch.int64, self.device)
        input_ids, positions_t, out_cache_loc = packed[:3]
        req_rows, seq_lens_t, last_t = packed[-3:]
        sample_rows = packed[3] if t.as_rows else None
        if t.pending_at:
            assert prev_tokens is not None, "the previous step unsampled"
            if _all_of(t.pending_at, n) and _all_of(t.pending_src, len(prev_tokens)):
                # The overlapped decode step: every input is the previous step's token of
                # the same row. No table, no scatter: the sampled tensor is the input.
                input_ids = prev_tokens
            else:
                at, src = pack_aligned([t.pending_at, t.pending_src], torch.int64, self.device)
                input_ids = input_ids.clone()
                input_ids[at] = prev_tokens[src]
        return ForwardBatch(
            mode=ForwardMode.DECODE if t.is_decode or t.as_rows else ForwardMode.EXTEND,
            input_ids=input_ids,
            positions=positions_t,
            out_cache_loc=out_cache_loc,
            req_rows=req_rows,
            seq_lens=seq_lens_t,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            kv_pool=self.kv,
            req_to_token=self.req_to_token,
            last_indices=last_t,
            sample_rows=sample_rows,
        )

    def run(self, batch: ForwardBatch, extra: list[int]) -> torch.Tensor:
        """The forward pass of `batch` (replayed from a CUDA graph when one fits): its logits;
        `extra` token indices' final hidden states are left in `batch.extra_hidden`."""
        if extra:
            batch.extra_indices = to_device(extra, torch.int64, self.device)
        if self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.replay(batch)
        else:
            logits = self.model(batch)
        return logits if batch.sample_rows is None else logits[batch.sample_rows]

    def rows_limit(self) -> int:
        """The most new tokens a step runs as decode rows (extend_rows.py)."""
        limit = self.rows_max
        if self.graphs is not None:
            limit = min(extend_rows.MAX_ROWS if limit is None else limit, self.graphs.max_bs)
        return limit or 0

    def _as_rows(self, tables: StepTables, pooled: bool) -> bool:
        """Whether the step runs as decode rows (extend_rows.py)."""
        return not pooled and extend_rows.fits(tables, self.rows_limit())

    @torch.inference_mode()
    def forward(self, plan: StepPlan, prev: InFlight | None = None) -> Forward:
        """Queue the step's forward pass (and the prompt logprobs it carries); nothing waits
        for the device. `prev`: the step in flight, whose sampled tokens are this one's
        pending inputs. Under tensor parallelism the step's tables go to the other ranks
        first, which run the same kernels (distributed/follower.py)."""
        self.req_to_token.flush()  # the slots planning allocated, for the kernels to read
        tables = self.step_tables(plan, prev)
        prompt_lp = (
            None if plan.is_decode else PromptLogprobTargets.build(plan.reqs, plan.extend_lens)
        )
        if prompt_lp is not None:
            tables.extra = prompt_lp.positions
        rows = [i for i in range(len(plan.reqs)) if plan.samples(i)]
        # Pooled positions follow the prompt-logprob ones; only this rank reads them.
        pool = None if plan.is_decode else PoolTargets.build(plan.reqs, plan.extend_lens)
        tables.as_rows = self._as_rows(tables, pool is not None)
        if self.channel is not None:
            tables.sampling_rows = len(rows)
            log = self.req_to_token.flush_log
            assert log is not None
            tables.add_writes(log)
            log.clear()
            self.channel.send(tables)
        prev_tokens = prev.sampled.tokens if prev is not None and prev.sampled else None
        batch = self.batch_from(tables, prev_tokens)
        logits = self.run(batch, tables.extra + (pool.positions if pool else []))  # [bs, vocab]
        n_lp = len(tables.extra)
        if prompt_lp is not None:
            assert batch.extra_hidden is not None
            prompt_lp.compute(batch.extra_hidden[:n_lp], self.model.lm_head)
        if pool is not None:
            assert batch.extra_hidden is not None
            pool.take(batch.extra_hidden[n_lp:])
        return Forward(plan, rows, logits, tables.as_rows)

    def share(self, sampled: Sampled) -> None:
        """A step's sampled tokens to the other ranks (their next step may read them on the
        device), when the step sampled any."""
        if self.channel is not None and sampled.tokens.numel():
            self.tp.broadcast(sampled.tokens)

    def release_graphs(self) -> None:
        """Free the CUDA graphs (eager steps from then on). Before a tensor-parallel group is
        torn down: a live graph that captured NCCL collectives makes NCCL's teardown wait for
        ever (two H100s, torch 2.11: destroy_process_group hung on both ranks with a graph
        alive, and took 0.4 s once it was freed)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def stop_followers(self) -> None:
        if self.channel is not None:
            self.channel.send_stop()


def _all_of(indices: list[int], n: int) -> bool:
    """Whether `indices` is 0, 1, ..., n - 1."""
    return len(indices) == n and indices == list(range(n))
