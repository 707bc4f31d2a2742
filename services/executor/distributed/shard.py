"""Which part of a checkpoint tensor fills which rows of a parameter: the vocabulary of
weights/loader.py, of the sharded layers (layers.py) and of the quantized formats (quant/).
Kept apart from both so each can import it without importing the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Which part of a checkpoint tensor a rank reads: rows (dim 0) or columns (dim 1)
    [start, end) of a dimension whose full size is `full`; `dim` None: all of it."""

    dim: int | None = None
    start: int = 0
    end: int = 0
    full: int = 0

    def index(self, ndim: int) -> tuple[slice, ...]:
        if self.dim is None:
            return tuple(slice(None) for _ in range(ndim))
        return tuple(
            slice(self.start, self.end) if d == self.dim else slice(None) for d in range(ndim)
        )


WHOLE = Shard()
# (first row of the parameter it fills, end row, the part of the checkpoint tensor)
LoadPlan = tuple[int, int, Shard]
