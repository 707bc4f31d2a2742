"""Triton for decode, FlashInfer for prefill: what `--attention-backend auto` runs on CUDA
when FlashInfer is installed (radixserve[flashinfer]).

Each case goes to the faster backend, measured on an H100 (Llama-3.1-8B shapes, bf16;
`gpu_bench --sections flashinfer_kernel` and the README): FlashInfer's prefill ran causal
attention at 520-590 TFLOP/s against Triton's 300-320 and took a 100,000-token prompt's time
to its first token from 10.7 s to 7.3 s; decode steps were faster on Triton end to end (issue
26's 256 x 512 row at 74.5% of its roofline against 72.3%, 64 x 2,000 at 84.5% against
82.8%), with no plan to make before each CUDA graph replay. Latent attention (MLA) has no
FlashInfer kernel here: it stays on Triton in both cases.
"""

from __future__ import annotations

import torch

from services.executor.attention import AttentionBackend
from services.executor.attention.flashinfer_backend import FlashInferBackend
from services.executor.attention.triton_backend import TritonBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode


class TritonDecodeFlashInferPrefill(AttentionBackend):
    def __init__(self) -> None:
        self.triton = TritonBackend()
        self.flashinfer = FlashInferBackend()

    def reserve_decode(
        self, *, max_batch_size: int, num_heads: int, head_dim: int, device: torch.device | str
    ) -> None:
        self.triton.reserve_decode(
            max_batch_size=max_batch_size, num_heads=num_heads, head_dim=head_dim, device=device
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # Triton's for every batch: MLA layers run it in both cases (its extend tables are
        # three small host-to-device copies).
        self.triton.init_forward_metadata(batch)
        if batch.mode is ForwardMode.EXTEND:
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
        if batch.mode is ForwardMode.EXTEND:
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
