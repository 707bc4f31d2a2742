"""Attention backends: store the new tokens' K/V in the pool, then attend over each context.

The model gets its backend at construction (`get_backend(name)` -> one instance shared by all
layers) and calls `backend.forward` once per layer. Backends are looked up by name and imported
only when asked for, so a CPU run never imports a GPU kernel module.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from abc import ABC, abstractmethod

import torch

from services.executor.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """One attention layer's work for a ForwardBatch, for EXTEND and DECODE alike."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """Called by the model once per forward, before layer 0: build whatever the layers
        share (gather indices, masks). Backends that need nothing leave it alone."""

    @abstractmethod
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
        """Write k/v to `batch.kv_pool` at `batch.out_cache_loc` (unless `kv_stored`: the
        caller wrote them, through `fused_kv_store`'s buffers), then attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], with
        num_heads a multiple of num_kv_heads (GQA). Each request attends over its whole context,
        read through `batch.req_to_token.req_to_token[row, :seq_len]`; new token i of a request
        with prefix p sees positions 0..p+i. Scores are q.k * scale (None: 1/sqrt(head_dim)),
        then, with a softcap, softcap * tanh(score / softcap). A window (sliding-window layers)
        hides keys: the query at position t sees keys at positions > t - window only (the pool
        keeps them all). Returns [num_tokens, num_heads, head_dim] in q's dtype.
        """

    def fused_kv_store(
        self, layer_id: int, batch: ForwardBatch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_buffer, v_buffer) of layer `layer_id` where the caller may write the new tokens'
        K/V itself, in the same launch as their rotation (kernels/rotary.py's KVStore), and
        then call forward with kv_stored=True; None where this backend stores them."""
        return None

    def forward_mla(
        self,
        q: torch.Tensor,
        latent: torch.Tensor | None,
        layer_id: int,
        batch: ForwardBatch,
        sm_scale: float,
        v_dim: int,
    ) -> torch.Tensor:
        """DeepSeek's latent attention with the projections absorbed: write `latent` to the
        pool's latent rows (`KVPool.set_latent`) at `batch.out_cache_loc`, then attend, MQA.

        q: [num_tokens, num_heads, cache_dim]; latent: [num_tokens, 1, cache_dim], both the
        latent part (`v_dim` = kv_lora_rank wide) then the rotated part; None where the caller
        has written the rows already. Keys are the cached
        rows, values their first `v_dim` elements; masks as in `forward`, scale `sm_scale`.
        Returns [num_tokens, num_heads, v_dim] in q's dtype.
        """
        raise NotImplementedError(f"{type(self).__name__} has no latent (MLA) attention")


def pool_buffers(
    layer_id: int, batch: ForwardBatch, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`fused_kv_store` for a backend that stores with kernels/store_kv: the layer's pool
    buffers when they hold `dtype` (an fp8 pool takes store_kv's cast), else None."""
    k_buffer = batch.kv_pool.k_buffers[layer_id]
    if k_buffer.dtype != dtype or not batch.kv_pool.v_buffers:
        return None
    return k_buffer, batch.kv_pool.v_buffers[layer_id]


# name -> (module, class)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("services.executor.attention.torch_ref", "TorchRefBackend"),
    "triton": ("services.executor.attention.triton_backend", "TritonBackend"),
    "flashinfer": ("services.executor.attention.flashinfer_backend", "FlashInferBackend"),
    # what "auto" resolves to on CUDA with FlashInfer installed (split_backend.py)
    "triton+flashinfer": (
        "services.executor.attention.split_backend",
        "FlashInferWithTriton",
    ),
}


def auto_backend(device_type: str, cache_in_model_dtype: bool) -> str:
    """`--attention-backend auto`: the torch reference on the CPU; on CUDA Triton, with
    FlashInfer's prefill and large decode batches when radixserve[flashinfer] is installed and
    the cache is in the model's dtype (FlashInfer's kernels here read no fp8 cache)."""
    if device_type != "cuda":
        return "torch"
    if cache_in_model_dtype and importlib.util.find_spec("flashinfer") is not None:
        try:
            importlib.import_module("flashinfer")
        except Exception as e:  # installed but broken: serve on Triton rather than not at all
            log.warning("FlashInfer is installed but does not import (%r): attention on Triton", e)
            return "triton"
        return "triton+flashinfer"
    return "triton"


def get_backend(name: str) -> AttentionBackend:
    """A new instance of the backend registered under `name`."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    backend: AttentionBackend = getattr(importlib.import_module(module_name), class_name)()
    return backend
