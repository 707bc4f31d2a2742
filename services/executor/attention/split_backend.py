"""Each case on the faster backend: what `--attention-backend auto` runs on CUDA when
FlashInfer is installed (radixserve[flashinfer]).

Measured on an H100 (Llama-3.1-8B shapes, bf16; `gpu_bench --sections flashinfer_kernel`, the
`scale` rows on each backend, and the README's "FlashInfer"):
- prefill on FlashInfer: causal attention at 520-700 TFLOP/s against Triton's 300-320; a
  100,000-token prompt's time to its first token 10.7 s on Triton, 6.5 s here;
- decode batches of `FLASHINFER_DECODE_MIN_BS` or more on FlashInfer: issue 26's 256 x 512
  row 17.71 ms a step against Triton's 18.07 (76.2% of its roofline against 74.8%), 64 x 2,000
  13.21 against 13.27 ms (`loadtest/results/gpu_decode_ab_h100_run1.json`);
- smaller decode batches on Triton: one request at 1,000 keys 5.66 ms a step against 5.77
  (FlashInfer plans on the host before each replay, which a short step feels).
FlashInfer plans on the host before each replay; with only the schedule re-planned
(flashinfer_backend's `_replan`) the host spent 2.3 ms on a decode step at 256 requests
against Triton's 2.7, and 4.2 ms before (`gpu_host256_h100_auto_run1.json`,
`gpu_scale_h100_run5.json`). Its fixed split size, which would let a replay reuse the last
plan, fails inside CUDA graphs once the chunks outnumber the graph's padded batch
(FlashInfer 0.5.3).
Latent attention (MLA) has no FlashInfer kernel here: it stays on Triton in every case, and so
does a model whose head dim FlashInfer's kernels do not take (`FLASHINFER_HEAD_DIMS`: a head
dim of 16 failed at the first decode graph's capture with "Invalid configuration", FlashInfer
0.5.3; Phi-3's is 96).
"""

from __future__ import annotations

import torch

from services.executor.attention import AttentionBackend
from services.executor.attention.flashinfer_backend import FLASHINFER_HEAD_DIMS, FlashInferBackend
from services.executor.attention.triton_backend import TritonBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode

FLASHINFER_DECODE_MIN_BS = 64


class FlashInferWithTriton(AttentionBackend):
    def __init__(self, flashinfer_decode_min_bs: int | None = None) -> None:
        self.triton = TritonBackend()
        self.flashinfer = FlashInferBackend()
        if flashinfer_decode_min_bs is None:  # read now: the GPU tests lower it
            flashinfer_decode_min_bs = FLASHINFER_DECODE_MIN_BS
        self.flashinfer_decode_min_bs = flashinfer_decode_min_bs

    def _on_flashinfer(self, batch: ForwardBatch) -> bool:
        if batch.kv_pool.k_buffers[0].shape[-1] not in FLASHINFER_HEAD_DIMS:
            return False
        return batch.mode is ForwardMode.EXTEND or batch.batch_size >= self.flashinfer_decode_min_bs

    # -- CUDA graphs (services/executor/cuda_graph.py): both backends hold decode buffers ----

    def reserve_decode(
        self, *, max_batch_size: int, num_heads: int, head_dim: int, device: torch.device | str
    ) -> None:
        for backend in (self.triton, self.flashinfer):
            backend.reserve_decode(
                max_batch_size=max_batch_size, num_heads=num_heads, head_dim=head_dim,
                device=device,
            )  # fmt: skip

    def prepare_capture(self, bs: int | None) -> None:
        self.flashinfer.prepare_capture(bs)

    def prepare_replay(self, bs: int, seq_lens: list[int]) -> None:
        if bs >= self.flashinfer_decode_min_bs:
            self.flashinfer.prepare_replay(bs, seq_lens)

    # -- a forward ---------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # Triton's for every batch: MLA layers run it in every case (a few small copies).
        self.triton.init_forward_metadata(batch)
        if self._on_flashinfer(batch):
            self.flashinfer.init_forward_metadata(batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        *,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        backend: AttentionBackend = self.triton
        if self._on_flashinfer(batch):
            backend = self.flashinfer
        return backend.forward(
            q, k, v, layer_id, batch, scale=scale, window=window, softcap=softcap,
            kv_stored=kv_stored,
        )  # fmt: skip

    def fused_kv_store(
        self, layer_id: int, batch: ForwardBatch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.triton.fused_kv_store(layer_id, batch, dtype)

    def forward_mla(
        self,
        q: torch.Tensor,
        latent: torch.Tensor | None,
        layer_id: int,
        batch: ForwardBatch,
        sm_scale: float,
        v_dim: int,
    ) -> torch.Tensor:
        return self.triton.forward_mla(q, latent, layer_id, batch, sm_scale, v_dim)
