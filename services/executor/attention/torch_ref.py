"""The torch reference attention backend: plain SDPA, correct for any batch, fast enough on CPU.

EXTEND loops over requests (prefills are few and long). DECODE is one padded SDPA call over
the whole batch, since a decode step is many short requests and per-request calls would
dominate a CPU step. MLA (`forward_mla`) is the same attention with one KV head whose values
are the first `v_dim` elements of its keys. An fp8 pool (--kv-cache-dtype) is widened to the
query's dtype as it is gathered, exactly (kernels/fp8_kv.py); KVPool.set_kv does the
saturating store.

A sliding window is one more mask, built once per forward for each window the layers use; a
softcap (which SDPA lacks) takes the same masks through a plain softmax, in HF's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.fp8_kv import gather_kv
from services.executor.attention import AttentionBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _ExtendRequest:
    start: int  # first token along the batch's token dimension
    extend: int
    slots: torch.Tensor  # [seq_len] KV slots of the whole context
    mask: torch.Tensor | None  # [extend, seq_len] bool; None: no prefix, plain causal
    prefix: int = 0
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        if window is None:
            return self.mask
        if window not in self.windowed:
            seq_len = self.prefix + self.extend
            cols = torch.arange(seq_len, device=self.slots.device)
            q_pos = torch.arange(self.prefix, seq_len, device=self.slots.device)[:, None]
            self.windowed[window] = (cols[None, :] <= q_pos) & (cols[None, :] > q_pos - window)
        return self.windowed[window]


@dataclass
class _Metadata:
    """What every layer of one forward shares: built once, before layer 0."""

    batch: ForwardBatch
    extend: list[_ExtendRequest]  # EXTEND only
    decode_slots: torch.Tensor | None  # DECODE: [bs, max_len]; padding holds stale slots
    decode_mask: torch.Tensor | None  # DECODE: [bs, 1, 1, max_len] bool, True = attend
    decode_windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask

    def decode_mask_for(self, window: int | None) -> torch.Tensor:
        assert self.decode_mask is not None and self.decode_slots is not None
        if window is None:
            return self.decode_mask
        if window not in self.decode_windowed:
            cols = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
            lo = (self.batch.seq_lens - window)[:, None, None, None]
            self.decode_windowed[window] = self.decode_mask & (cols >= lo)
        return self.decode_windowed[window]


class TorchRefBackend(AttentionBackend):
    def __init__(self) -> None:
        self._meta: _Metadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._meta = _build_metadata(batch)

    def _metadata(self, batch: ForwardBatch) -> _Metadata:
        """This forward's metadata (built here when called without the model: tests, kernels)."""
        if self._meta is None or self._meta.batch is not batch:
            self.init_forward_metadata(batch)
        assert self._meta is not None
        return self._meta

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
        meta = self._metadata(batch)
        if not kv_stored:
            batch.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf = batch.kv_pool.k_buffers[layer_id]
        v_buf = batch.kv_pool.v_buffers[layer_id]
        attn = _Attend(scale, window, softcap)
        if batch.mode is ForwardMode.DECODE:
            return _decode(q, k_buf, v_buf, meta, attn)
        return _extend(q, k_buf, v_buf, meta, attn)

    def forward_mla(
        self,
        q: torch.Tensor,
        latent: torch.Tensor | None,
        layer_id: int,
        batch: ForwardBatch,
        sm_scale: float,
        v_dim: int,
    ) -> torch.Tensor:
        meta = self._metadata(batch)
        if latent is not None:  # else the caller wrote the rows (kernels/mla_prep)
            batch.kv_pool.set_latent(layer_id, batch.out_cache_loc, latent)
        buf = batch.kv_pool.k_buffers[layer_id]  # [slots, 1, cache_dim]
        # Values are the latent part of the same rows: a view, nothing copied.
        attn = _Attend(sm_scale, None, None)
        if batch.mode is ForwardMode.DECODE:
            return _decode(q, buf, buf[..., :v_dim], meta, attn)
        return _extend(q, buf, buf[..., :v_dim], meta, attn)


def _build_metadata(batch: ForwardBatch) -> _Metadata:
    table = batch.req_to_token.req_to_token
    if batch.mode is ForwardMode.DECODE:
        max_len = max(batch.seq_lens_cpu)
        slots = table[batch.req_rows, :max_len]
        cols = torch.arange(max_len, device=slots.device)
        mask = (cols[None, :] < batch.seq_lens[:, None])[:, None, None, :]
        return _Metadata(batch, [], slots, mask)
    reqs = []
    start = 0
    for row, prefix, extend in zip(
        batch.req_rows.tolist(), batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True
    ):
        seq_len = prefix + extend
        prefix_mask: torch.Tensor | None = None
        if prefix:
            # New token i sits at position prefix + i and sees everything up to it.
            cols = torch.arange(seq_len, device=table.device)
            last_visible = torch.arange(prefix, seq_len, device=table.device)
            prefix_mask = cols[None, :] <= last_visible[:, None]
        reqs.append(_ExtendRequest(start, extend, table[row, :seq_len], prefix_mask, prefix))
        start += extend
    return _Metadata(batch, reqs, None, None)


@dataclass(frozen=True)
class _Attend:
    """One layer's attention parameters (see AttentionBackend.forward)."""

    scale: float | None
    window: int | None
    softcap: float | None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [..., heads, n, d], k/v [..., kv_heads, L, d]; mask [..., n, L] bool, None for
        plain causal (n == L)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


def _extend(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _Metadata, attn: _Attend
) -> torch.Tensor:
    out = q.new_empty(*q.shape[:2], v_buf.shape[-1])
    for r in meta.extend:
        qi = q[r.start : r.start + r.extend].transpose(0, 1)  # [num_heads, extend, head_dim]
        # [num_kv_heads, seq_len, head_dim]
        ki = gather_kv(k_buf, r.slots).transpose(0, 1).to(q.dtype)
        vi = gather_kv(v_buf, r.slots).transpose(0, 1).to(q.dtype)
        oi = attn(qi, ki, vi, r.mask_for(attn.window))
        out[r.start : r.start + r.extend] = oi.transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _Metadata, attn: _Attend
) -> torch.Tensor:
    assert meta.decode_slots is not None
    # [bs, num_kv_heads, max_len, head_dim]; padded columns are masked out.
    keys = gather_kv(k_buf, meta.decode_slots).transpose(1, 2).to(q.dtype)
    values = gather_kv(v_buf, meta.decode_slots).transpose(1, 2).to(q.dtype)
    mask = meta.decode_mask_for(attn.window)
    out = attn(q.unsqueeze(2), keys, values, mask)  # [bs, num_heads, 1, head_dim]
    return out.squeeze(2)
