"""Load progress of a starting executor, for `radixserve serve`'s progress bar."""

from __future__ import annotations

import msgspec


class LoadProgress(msgspec.Struct, kw_only=True, frozen=True):
    instance: str
    phase: str  # "tokenizer", "weights", "kv pool", "cuda graphs", "warm-up"
    fraction: float  # of the whole load, 0 to 1
    ts: float
