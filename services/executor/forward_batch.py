"""What one forward pass needs: the new tokens, where their K/V go, and each request's context."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.packing import upload


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: several new tokens per request, after an optional cached prefix
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """Requests are laid out one after another along the token dimension.

    Tensors live on the model's device; the `_cpu` lists mirror them for loops on the host.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each new token in its request
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each new token writes
    req_rows: torch.Tensor  # [bs] int64, each request's row in req_to_token
    seq_lens: torch.Tensor  # [bs] int64, prefix + new tokens after this step
    prefix_lens_cpu: list[int]  # [bs] tokens already in the KV pool before this step
    extend_lens_cpu: list[int]  # [bs] new tokens this step (1 each for decode)
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    # [bs] int64 on the device, each request's last new token along the token dimension;
    # the model runner sends it with the other tables, CUDA-graph replay has its own
    last_indices: torch.Tensor | None = None
    # Token indices whose final hidden states are wanted too (prompt logprobs); the model
    # leaves them in `extra_hidden` ([len(extra_indices), hidden]).
    extra_indices: torch.Tensor | None = None
    extra_hidden: torch.Tensor | None = None
    # An extend run as decode rows (extend_rows.py): the rows whose logits are the
    # requests', each one's last new token; None where every row is a request's.
    sample_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu, strict=True)]

    def output_rows(self) -> torch.Tensor | None:
        """The token rows whose final hidden states the model returns: each request's last
        new token, then `extra_indices`. None where that is every row in order (decode
        without extras), so the model skips a gather of its hidden state and residual (two
        launches a decode step)."""
        if self.mode is ForwardMode.DECODE and self.extra_indices is None:
            return None
        last = self.last_token_indices()
        if self.extra_indices is not None:
            last = torch.cat([last, self.extra_indices])
        return last

    def last_token_indices(self) -> torch.Tensor:
        """Index along the token dimension of each request's last new token: [bs]."""
        if self.last_indices is not None:
            return self.last_indices
        ends = torch.tensor(self.extend_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        # Pinned and queued: a blocking copy would hold the host until every layer ran.
        return upload(ends, self.input_ids.device)
