"""What the ranks other than 0 run: receive each step's tables, run the same forward pass, take
part in its collectives, and keep the step's sampled tokens for the next one.

A follower plans nothing and samples nothing: rank 0 does, and every rank's KV pool and request
table stay the same because every write to the table comes with the step (steps.py). The
collectives of one step happen in the same order on every rank: the tables (host), the
forward pass's all-reduces and all-gathers (in the model), the prompt logprobs' LM head, one
slice at a time (as sampling/logprobs.py computes them on rank 0), and the sampled tokens.
"""

from __future__ import annotations

import logging

import torch

from services.executor.distributed.group import TPGroup
from services.executor.distributed.steps import HostChannel
from services.executor.model_runner import ModelRunner
from services.executor.sampling.logprobs import PROMPT_SLICE

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, runner: ModelRunner, tp: TPGroup) -> None:
        assert not tp.is_leader, "rank 0 runs the engine"
        self.runner, self.tp = runner, tp
        self.channel = HostChannel(tp.host_group)
        self.steps = 0

    @torch.inference_mode()
    def run(self) -> None:
        """Until rank 0 says stop."""
        runner = self.runner
        prev_tokens: torch.Tensor | None = None
        while (t := self.channel.receive()) is not None:
            for rows, cols, vals in t.writes():
                runner.req_to_token.apply(rows, cols, vals)
            batch = runner.batch_from(t, prev_tokens)
            runner.run(batch, t.extra)
            if t.extra:
                hidden = batch.extra_hidden
                assert hidden is not None
                for s in range(0, len(t.extra), PROMPT_SLICE):
                    runner.model.lm_head(hidden[s : s + PROMPT_SLICE])
            prev_tokens = None
            if t.sampling_rows:
                tokens = torch.empty(t.sampling_rows, dtype=torch.int64, device=runner.device)
                prev_tokens = self.tp.broadcast(tokens)
            self.steps += 1
        log.info("rank %d: rank 0 stopped after %d steps", self.tp.rank, self.steps)
