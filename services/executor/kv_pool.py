"""The token-slot KV pool and the request-to-slot table.

Every cached token of every request owns one slot: K and V of all layers live at that slot's
row in the per-layer buffers. Requests see their tokens through `req_to_token`, a row per
running request listing its slots in order, so attention reads any request's context with one
gather and a request's slots need not be contiguous.
"""

from __future__ import annotations

import torch

from kernels.fp8_kv import store_into
from services.executor.model_config import ModelConfig
from services.executor.packing import pack_aligned


class KVPool:
    """Per-layer K/V buffers of `num_slots` rows and a free list of slot indices.

    k_buffers[layer]: [num_slots, num_kv_heads, head_dim] (v_buffers alike), in `dtype`: the
    model's, or float8_e5m2 / float8_e4m3fn (`--kv-cache-dtype`), stored with scale 1.0 and
    read back by a cast (kernels/fp8_kv.py).
    Slot `num_slots` (one past the end) is a padding slot that is never handed out: padded
    batches write their junk there.
    values=False (MLA's latent cache): k_buffers[layer] is [num_slots, 1, cache_dim], holding
    each token's latent then its rotated key part, and v_buffers is empty.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        values: bool = True,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"KV pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v_layers = num_layers if values else 0
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(v_layers)]
        self.latent = not values
        # The free slots, kept on the CPU because allocation is bookkeeping, not math: those
        # handed out and returned (a stack: the last returned go out first), then those never
        # handed out, [_fresh, num_slots), in order. Not one list of every slot: a tiny
        # model's 256-byte rows make 470 million slots of an H200, a list of 17 GB that took
        # 15-20 s to build.
        self._returned: list[int] = []
        self._fresh = 0

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    def num_free(self) -> int:
        return len(self._returned) + self.num_slots - self._fresh

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free()

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free():
            raise MemoryError(f"KV pool has {self.num_free()} free slots, {n} requested")
        if n == 0:
            return []
        reused = min(n, len(self._returned))
        out = self._returned[len(self._returned) - reused :]
        del self._returned[len(self._returned) - reused :]
        out.reverse()
        if reused < n:
            out.extend(range(self._fresh, self._fresh + n - reused))
            self._fresh += n - reused
        return out

    def free(self, slots: list[int]) -> None:
        self._returned.extend(slots)

    def free_slots(self) -> list[int]:
        """Every free slot (integrity checks): one freed that was never allocated is there
        twice."""
        return [*self._returned, *range(self._fresh, self.num_slots)]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slots: [n] int64; k, v: [n, num_kv_heads, head_dim]."""
        store_into(self.k_buffers[layer], slots, k)
        store_into(self.v_buffers[layer], slots, v)

    def set_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Store new tokens' MLA cache rows. slots: [n] int64; latent: [n, 1, cache_dim]."""
        assert self.latent, "set_latent on a K/V pool"
        store_into(self.k_buffers[layer], slots, latent)

    def nbytes(self) -> int:
        """Bytes of every K and V buffer (the padding slot included)."""
        return sum(b.numel() * b.element_size() for b in (*self.k_buffers, *self.v_buffers))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_heads: int = 0) -> int:
    """The pool's bytes for one token over every layer, in `dtype`: K and V of `kv_heads`
    (0: all of the model's), or MLA's one latent row (replicated on every rank)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    if config.mla is not None:
        return config.num_layers * config.mla.cache_dim * elem
    return 2 * config.num_layers * (kv_heads or config.num_kv_heads) * config.head_dim * elem


def make_kv_pool(
    config: ModelConfig,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_heads: int = 0,
) -> KVPool:
    """The pool layout the model's attention reads: K/V of `kv_heads` heads per rank (0: all
    of them), or MLA's latent rows."""
    if config.mla is not None:
        mla = config.mla
        return KVPool(num_slots, config.num_layers, 1, mla.cache_dim, dtype, device, values=False)
    heads = kv_heads or config.num_kv_heads
    return KVPool(num_slots, config.num_layers, heads, config.head_dim, dtype, device)


class ReqToTokenPool:
    """`req_to_token[row, i]` is the KV slot of token i of the request holding `row`.

    One extra row (`pad_row`) is never handed out: padded batch entries (CUDA-graph decode
    rounds the batch up) point at it, and it maps every position to the pool's padding slot.
    """

    def __init__(
        self, max_reqs: int, max_context: int, device: torch.device | str, pad_slot: int = 0
    ) -> None:
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context), dtype=torch.int64, device=device
        )
        self.req_to_token[max_reqs].fill_(pad_slot)
        self.pad_row = max_reqs
        self.max_context = max_context
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))
        # Writes not yet on the device, as flat (row, position, slot) columns: one copy and
        # one scatter per step, where a write per request would cost a copy and a kernel
        # launch each (64 decoding requests: about a millisecond of host time per step).
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._vals: list[int] = []
        self._written: set[int] = set()  # rows with a write since the last flush
        # Under tensor parallelism every rank keeps the same table: rank 0 records each
        # flush's writes (in order) for the others (distributed/steps.py); None: no record.
        self.flush_log: list[tuple[list[int], list[int], list[int]]] | None = None

    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request rows")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        """req_to_token[row, start : start + len(slots)] = slots, applied at the next flush
        (which every forward pass does first)."""
        if start + len(slots) > self.max_context:
            raise ValueError(f"request row overflow: {start}+{len(slots)} > {self.max_context}")
        if not slots:
            return
        if row in self._written:
            # A scatter's order among equal indices is undefined on CUDA: a second write to a
            # row (it may overlap the first) goes in the next one.
            self.flush()
        self._written.add(row)
        self._rows += [row] * len(slots)
        self._cols += range(start, start + len(slots))
        self._vals += slots

    def write_many(
        self, rows: list[int], starts: list[int], lens: list[int], slots: list[int]
    ) -> None:
        """`write(rows[i], starts[i], <the next lens[i] of slots>)` for each i; `rows` distinct
        (one per request of a step). A decode step writes one slot per request: that case
        extends the pending columns in bulk instead of a call per request."""
        if lens.count(1) == len(lens) and self._written.isdisjoint(rows):
            if starts and max(starts) >= self.max_context:
                raise ValueError(f"request row overflow: {max(starts)}+1 > {self.max_context}")
            self._written.update(rows)
            self._rows += rows
            self._cols += starts
            self._vals += slots
            return
        at = 0
        for row, start, n in zip(rows, starts, lens, strict=True):
            self.write(row, start, slots[at : at + n])
            at += n

    def flush(self) -> None:
        """Apply the pending writes to the device table."""
        if not self._rows:
            return
        if self.flush_log is not None:
            self.flush_log.append((self._rows, self._cols, self._vals))
        self.apply(self._rows, self._cols, self._vals)
        self._rows, self._cols, self._vals = [], [], []
        self._written.clear()

    def apply(self, rows: list[int], cols: list[int], vals: list[int]) -> None:
        """req_to_token[rows[i], cols[i]] = vals[i] on the device, in one copy and scatter."""
        table = self.req_to_token
        r, c, v = pack_aligned([rows, cols, vals], torch.int64, table.device)
        table[r, c] = v
