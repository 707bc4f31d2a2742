"""The sharded layers of tensor parallelism, Megatron's layout (as SGLang and vLLM use it):

- column-parallel (qkv, gate_up): each rank holds a slice of the output rows; no
  communication, the next layer reads the rank's slice;
- row-parallel (o_proj, down): each rank holds a slice of the input columns; the partial
  products are summed by one all-reduce; a bias is added once, after it;
- vocab-parallel embedding and LM head: each rank holds a slice of the vocabulary's rows
  (padded to a multiple of the ranks); the embedding's lookups outside the slice are zero and
  the all-reduce fills them in; the LM head's logits are all-gathered, so every rank has the
  whole row (rank 0 samples it; the others run the same kernels and discard it).

Every sharded module says which part of which checkpoint tensor fills which of its rows
(`load_plan`), so the loader reads only the rank's part of each tensor (weights/loader.py).
With a group of one, every slice is the whole tensor and nothing is communicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.shard import WHOLE, LoadPlan, Shard
from services.executor.models.linear import Linear


class ColumnParallelLinear(Linear):
    """Output rows split over the ranks. Several checkpoint tensors may be stacked into one
    (qkv from q, k, v): `parts` lists each one's (full rows, this rank's first row, rows)."""

    def __init__(
        self, in_features: int, parts: list[tuple[int, int, int]], bias: bool, tp: TPGroup
    ) -> None:
        super().__init__(in_features, sum(rows for _, _, rows in parts), bias=bias)
        self.parts, self.tp = parts, tp

    def load_plan(self, kind: str, index: int | None) -> LoadPlan:
        i = 0 if index is None else index
        at = sum(rows for _, _, rows in self.parts[:i])
        full, start, rows = self.parts[i]
        return at, at + rows, Shard(0, start, start + rows, full)


class RowParallelLinear(Linear):
    """Input columns split over the ranks; the partial outputs are summed (one all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        self.full_in = in_features
        super().__init__(tp.shard(in_features, "projection input size"), out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = self.method.apply(self, x)  # the bias is added once, after the sum
        self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def load_plan(self, kind: str, index: int | None) -> LoadPlan:
        if kind == "bias":  # added once, after the sum: every rank holds all of it
            return 0, self.out_features, WHOLE
        start = self.tp.rank * self.in_features
        return 0, self.out_features, Shard(1, start, start + self.in_features, self.full_in)


def vocab_shard(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(rows per rank, this rank's first row): the vocabulary padded to a multiple of the
    ranks, so every rank's slice has the same size."""
    per = -(-vocab // tp.size)
    return per, tp.rank * per


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        per, start = vocab_shard(vocab, tp)
        # a weight given: nn.Embedding skips its random init, which on the meta device
        # (weights/loader.py) goes through torch's reference ops and imported them: 1.6 s of
        # CPU at every executor start, for values the checkpoint replaces
        super().__init__(per, hidden, _weight=torch.empty(per, hidden))
        self.vocab, self.start, self.tp = vocab, start, tp
        # rows of this rank's slice that are real tokens (the last rank's tail is padding)
        self.real = max(0, min(per, vocab - start))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)

    def load_plan(self, kind: str, index: int | None) -> LoadPlan:
        return 0, self.real, Shard(0, self.start, self.start + self.real, self.vocab)


class ParallelLMHead(Linear):
    """Logits of this rank's vocabulary slice, all-gathered into every token's whole row.
    Kept in the model dtype: it may share its weight with the embedding."""

    quantizable = False

    def __init__(self, hidden: int, vocab: int, tp: TPGroup = SINGLE) -> None:
        per, start = vocab_shard(vocab, tp)
        super().__init__(hidden, per, bias=False)
        self.vocab, self.start, self.tp = vocab, start, tp
        self.real = max(0, min(per, vocab - start))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.tp.size == 1:
            return out
        return self.tp.all_gather_last(out)[..., : self.vocab]

    def load_plan(self, kind: str, index: int | None) -> LoadPlan:
        return 0, self.real, Shard(0, self.start, self.start + self.real, self.vocab)
