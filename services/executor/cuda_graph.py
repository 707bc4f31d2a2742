"""Decode steps replayed from CUDA graphs, one graph per batch size (padded up to the next).

A decode step of a large model is dozens of small kernels per layer; launching them one by one
costs more CPU time than the GPU spends on them at small batch sizes. Each graph is captured
once over static input buffers; a step copies its inputs into the first `bs` rows, points the
padding rows at the request table's padding row (which maps to the pool's padding slot), and
replays. Every graph shares one memory pool, captured largest first.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch

from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 up to max_bs (and max_bs itself)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_bs + 1, 16)]
    sizes = [s for s in sizes if s <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(
        self, model: Any, kv: KVPool, rows: ReqToTokenPool, max_bs: int, device: torch.device
    ) -> None:
        self.model = model
        self.kv = kv
        self.rows = rows
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((n,), kv.pad_slot, dtype=torch.int64, device=device)
        self.req_rows = torch.full((n,), rows.pad_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.last_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        backend = getattr(model, "backend", None)
        # A backend with host work per step the graph cannot hold (FlashInfer's plan) is told
        # which size it is capturing, and planned before each replay.
        self._prepare_capture = getattr(backend, "prepare_capture", None)
        self._prepare_replay = getattr(backend, "prepare_replay", None)
        reserve = getattr(backend, "reserve_decode", None)
        if reserve is not None:  # this rank's heads (all of them without tensor parallelism)
            # What attention returns per head: head_dim, or MLA's latent width.
            heads = model.num_heads
            head_dim = getattr(model, "decode_value_dim", model.config.head_dim)
            reserve(max_batch_size=n, num_heads=heads, head_dim=head_dim, device=device)

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            kv_pool=self.kv,
            req_to_token=self.rows,
            last_indices=self.last_indices[:bs],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            try:
                for bs in reversed(self.sizes):
                    batch = self._static_batch(bs)
                    if self._prepare_capture is not None:
                        self._prepare_capture(bs)
                    for _ in range(2):  # warm up: autotuning and lazy init outside the capture
                        self.model(batch)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        out = self.model(batch)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[bs] = graph
                    self.outputs[bs] = out
            finally:
                if self._prepare_capture is not None:
                    self._prepare_capture(None)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def release(self) -> None:
        """Free the graphs and their memory pool; nothing replays after this."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        self.max_bs = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch; valid until the next replay."""
        bs = batch.batch_size
        size = self.sizes[bisect.bisect_left(self.sizes, bs)]
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc, non_blocking=True)
        self.req_rows[:bs].copy_(batch.req_rows, non_blocking=True)
        self.seq_lens[:bs].copy_(batch.seq_lens, non_blocking=True)
        if size > bs:  # padding rows: attend to one padding slot, write to it
            self.out_cache_loc[bs:size].fill_(self.kv.pad_slot)
            self.req_rows[bs:size].fill_(self.rows.pad_row)
            self.seq_lens[bs:size].fill_(1)
            self.input_ids[bs:size].zero_()
            self.positions[bs:size].zero_()
        if self._prepare_replay is not None:
            self._prepare_replay(size, batch.seq_lens_cpu + [1] * (size - bs))
        self.graphs[size].replay()
        return self.outputs[size][:bs]
