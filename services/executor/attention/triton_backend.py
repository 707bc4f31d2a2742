"""The Triton attention backend: kernels/store_kv, extend_attention and decode_attention.

Semantics are TorchRefBackend's: K/V of the new tokens go to the pool first, then every
request attends over its context read through `req_to_token`, GQA; a layer's scale, sliding
window and softcap go to the kernels as arguments (the window and softcap as constexpr
switches: layers without them run the plain kernels).

DECODE is CUDA-graph friendly: neither `init_forward_metadata` nor `forward` reads a tensor
value on the host, and their launches and buffers depend only on the batch size. The
per-request split counts are computed on the device from `batch.seq_lens` into a persistent
buffer (so a graph that captures the model's whole forward recomputes them on replay), and
the split-K workspace persists across calls. Both grow only when a larger batch arrives:
call `reserve_decode` with the largest batch before capturing (a graph keeps pointers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kernels._checks import next_pow2, sm_count
from kernels.decode_attention import (
    DecodeWorkspace,
    choose_kv_pack,
    decode_attention,
    num_kv_splits_for,
)
from kernels.extend_attention import extend_attention
from kernels.fp8_widen import early_widening
from kernels.mla_decode import mla_decode
from kernels.mla_extend import mla_extend
from kernels.store_kv import store_kv
from services.executor.attention import AttentionBackend, pool_buffers
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.packing import pack_aligned


@dataclass
class _ExtendMetadata:
    prefix_lens: torch.Tensor  # [bs] int32
    extend_lens: torch.Tensor  # [bs] int32
    extend_starts: torch.Tensor  # [bs] int32, each request's first row along the tokens
    max_extend_len: int


# The CPU interpreter runs every chunk's program one after another, so chunks past the old
# default of 32 cost the CPU tests time and cover nothing more
INTERPRETER_MAX_SPLITS = 32
# stage 1's software pipelining depth at every batch size (see TritonBackend)
DECODE_STAGES = 3


@dataclass
class _SplitScratch:
    """fp32 scratch for decode's per-chunk partial outputs and log-sum-exps, flat: each step
    views it as [bs, heads, split_cap, head_dim], contiguous. Sized for the largest
    bs * split_cap of any batch up to max_batch_size, which is about 8 * max_batch_size, so
    a request alone may split 64 ways without the scratch of 64 chunks for every row."""

    out: torch.Tensor  # [rows * num_heads * head_dim]
    lse: torch.Tensor  # [rows * num_heads]
    max_batch_size: int
    num_heads: int
    head_dim: int

    def view(self, bs: int, split_cap: int) -> DecodeWorkspace:
        h, d = self.num_heads, self.head_dim
        return DecodeWorkspace(
            partial_out=self.out[: bs * h * split_cap * d].view(bs, h, split_cap, d),
            partial_lse=self.lse[: bs * h * split_cap].view(bs, h, split_cap),
        )


@dataclass
class _Metadata:
    """What every layer of one forward shares: built once, before layer 0."""

    batch: ForwardBatch
    extend: _ExtendMetadata | None  # EXTEND only
    num_kv_splits: torch.Tensor | None  # DECODE only: [bs] int32, a view of the persistent buffer
    split_cap: int  # DECODE only: the grid's chunks per request, a function of bs alone
    # DECODE only: the KV heads a program reads together, once layer 0 has filled the splits
    # (their length depends on it, and the query heads are known only there)
    kv_pack: int | None = None


class TritonBackend(AttentionBackend):
    """Decode splits each request's context into chunks of at least `min_split_len` keys, at
    most `max_kv_splits` of them, and on a GPU no more than `_split_cap` allows for the
    batch size: a few long requests split many ways, a large batch fewer.

    A batch too small to give every SM a (request, KV head) pair splits into chunks of only
    `small_batch_split_len` keys instead. Measured on an H100 (bf16, 32/8 heads of 128): bs 1
    at 256 keys took 9.8 us a layer with 32-key chunks against 17-20 us with 256; bs 256 at
    1,024 keys was best with 256-key chunks and three stages (415 us against 430-440 us).
    Later on an H100 (2026-11-27, `loadtest/results/gpu_decode_attention_h100_run1.json`): one
    request of 100,000 keys took 223 us a layer split 32 ways with two stages, 155 with 64
    chunks and 145 with 64 chunks and three stages (94% of the copy bandwidth); 8 requests of
    16,000 keys 194 us with two stages, 181 with three: hence 64 chunks at most and three
    stages at every batch size.

    A batch whose programs read several KV heads together (`choose_kv_pack`: large batches)
    splits into chunks of `packed_split_len` keys. Measured on an H100 (2026-11-27, packs of
    4, `loadtest/results/gpu_decode_pack_h100_run2.json`), microseconds a layer with chunks of
    256 / 512 / 1,024 keys: fp8 cache, 154 x 2,800 keys 435 / 406 / 411, 256 x 640
    238 / 231 / 222, 64 x 2,000 138 / 129 / 123; bf16 cache 658 / 638 / 628, 316 / 311 / 302,
    204 / 196 / 193."""

    def __init__(
        self,
        max_kv_splits: int = 64,
        min_split_len: int = 256,
        small_batch_split_len: int = 32,
        packed_split_len: int = 1024,
    ) -> None:
        if min(max_kv_splits, min_split_len, small_batch_split_len, packed_split_len) < 1:
            raise ValueError("max_kv_splits and the split lengths must be positive")
        self.max_kv_splits = max_kv_splits
        self.min_split_len = min_split_len
        self.small_batch_split_len = small_batch_split_len
        self.packed_split_len = packed_split_len
        self._meta: _Metadata | None = None
        self._scratch: _SplitScratch | None = None
        self._splits_buf: torch.Tensor | None = None  # [capacity] int32

    def reserve_decode(
        self, *, max_batch_size: int, num_heads: int, head_dim: int, device: torch.device | str
    ) -> None:
        """Allocate the decode buffers for batches up to `max_batch_size` now."""
        dev = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self._decode_workspace(max_batch_size, num_heads, head_dim, dev)
        self._splits(max_batch_size, dev)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        if batch.mode is ForwardMode.DECODE:
            bs, num_kv_heads = batch.batch_size, batch.kv_pool.k_buffers[0].shape[1]
            cap = self._split_cap(bs, num_kv_heads, device)
            self._meta = _Metadata(batch, None, self._splits(bs, device), cap)
            return
        extend_lens = batch.extend_lens_cpu
        starts = [0]
        for n in extend_lens[:-1]:
            starts.append(starts[-1] + n)
        # One host-to-device copy for the three [bs] tables, each 16-byte aligned: rows of
        # one [3, bs] tensor were aligned or not by bs % 4, one extend kernel binary each.
        prefix_lens, lens, starts_t = pack_aligned(
            [batch.prefix_lens_cpu, extend_lens, starts], torch.int32, device
        )
        extend = _ExtendMetadata(prefix_lens, lens, starts_t, max(extend_lens, default=0))
        self._meta = _Metadata(batch, extend, None, 0)

    def _fill_splits(self, meta: _Metadata, num_heads: int, k_buffer: torch.Tensor) -> int:
        """Layer 0 of a decode: each request's chunk count into the persistent buffer (on the
        device: a captured graph recomputes it on replay); returns the kv_pack every layer
        runs with."""
        if meta.kv_pack is not None:
            return meta.kv_pack
        assert meta.num_kv_splits is not None
        batch, device = meta.batch, k_buffer.device
        bs, num_kv_heads = batch.batch_size, k_buffer.shape[1]
        row_bytes = k_buffer.shape[2] * k_buffer.element_size()
        kv_pack = choose_kv_pack(bs, num_heads // num_kv_heads, num_kv_heads, row_bytes)
        if self._small_batch(bs, num_kv_heads, device):
            split_len = self.small_batch_split_len
        elif kv_pack > 1 and device.type == "cuda":  # the CPU tests choose their lengths
            split_len = self.packed_split_len
        else:
            split_len = self.min_split_len
        meta.num_kv_splits.copy_(
            num_kv_splits_for(batch.seq_lens, max_kv_splits=meta.split_cap, min_split_len=split_len)
        )
        meta.kv_pack = kv_pack
        return kv_pack

    def _metadata(self, batch: ForwardBatch) -> _Metadata:
        """This forward's metadata (built here when called without the model: tests, kernels)."""
        if self._meta is None or self._meta.batch is not batch:
            self.init_forward_metadata(batch)
        assert self._meta is not None
        return self._meta

    def _split_workspace(
        self, meta: _Metadata, bs: int, num_heads: int, head_dim: int, device: torch.device
    ) -> DecodeWorkspace:
        """The decode scratch as this batch's [bs, heads, split_cap] workspace."""
        return self._decode_workspace(bs, num_heads, head_dim, device).view(bs, meta.split_cap)

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
        k_buffer = batch.kv_pool.k_buffers[layer_id]
        v_buffer = batch.kv_pool.v_buffers[layer_id]
        if not kv_stored:
            loc = batch.out_cache_loc
            store_kv(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, out_cache_loc=loc)
        num_heads, head_dim = q.shape[1], q.shape[2]
        sm_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        table = batch.req_to_token.req_to_token
        if meta.num_kv_splits is not None:
            kv_pack = self._fill_splits(meta, num_heads, k_buffer)
            workspace = self._split_workspace(meta, q.shape[0], num_heads, head_dim, q.device)
            return decode_attention(
                q=q,
                k_buffer=k_buffer,
                v_buffer=v_buffer,
                req_to_token=table,
                req_rows=batch.req_rows,
                seq_lens=batch.seq_lens,
                num_kv_splits=meta.num_kv_splits,
                workspace=workspace,
                sm_scale=sm_scale,
                num_stages=DECODE_STAGES,
                window=window,
                softcap=softcap,
                kv_pack=kv_pack,
                # fp8 V widened in registers, and the running max moved only when it rises
                # RESCALE_AT: measured on an H100 (README, "fp8 tiles widened before shared
                # memory"); K widened early was slower there, so it stays late.
                early_v=early_widening(v_buffer.dtype, v_buffer.device),
                lazy_rescale=True,
            )
        assert meta.extend is not None
        return extend_attention(
            q=q,
            k_buffer=k_buffer,
            v_buffer=v_buffer,
            req_to_token=table,
            req_rows=batch.req_rows,
            prefix_lens=meta.extend.prefix_lens,
            extend_lens=meta.extend.extend_lens,
            extend_starts=meta.extend.extend_starts,
            max_extend_len=meta.extend.max_extend_len,
            sm_scale=sm_scale,
            window=window,
            softcap=softcap,
        )

    def fused_kv_store(
        self, layer_id: int, batch: ForwardBatch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pool's buffers when they hold `dtype` (an fp8 pool takes store_kv's cast)."""
        return pool_buffers(layer_id, batch, dtype)

    def forward_mla(
        self,
        q: torch.Tensor,
        latent: torch.Tensor | None,
        layer_id: int,
        batch: ForwardBatch,
        sm_scale: float,
        v_dim: int,
    ) -> torch.Tensor:
        """kernels/mla_decode and mla_extend over the latent pool, the same metadata and
        decode workspace as `forward` (its head dim is `v_dim`: reserve_decode with it)."""
        meta = self._metadata(batch)
        buffer = batch.kv_pool.k_buffers[layer_id]
        # One latent row per new token: a plain row copy (store_kv takes K and V pairs).
        if latent is not None:  # else the caller wrote the rows (kernels/mla_prep)
            batch.kv_pool.set_latent(layer_id, batch.out_cache_loc, latent)
        table = batch.req_to_token.req_to_token
        if meta.num_kv_splits is not None:
            self._fill_splits(meta, q.shape[1], buffer)  # one latent "head": never packed
            workspace = self._split_workspace(meta, q.shape[0], q.shape[1], v_dim, q.device)
            return mla_decode(
                q=q,
                buffer=buffer,
                rank=v_dim,
                req_to_token=table,
                req_rows=batch.req_rows,
                seq_lens=batch.seq_lens,
                num_kv_splits=meta.num_kv_splits,
                workspace=workspace,
                sm_scale=sm_scale,
                num_stages=DECODE_STAGES,
            )
        assert meta.extend is not None
        return mla_extend(
            q=q,
            buffer=buffer,
            rank=v_dim,
            req_to_token=table,
            req_rows=batch.req_rows,
            prefix_lens=meta.extend.prefix_lens,
            extend_lens=meta.extend.extend_lens,
            extend_starts=meta.extend.extend_starts,
            max_extend_len=meta.extend.max_extend_len,
            sm_scale=sm_scale,
        )

    def _small_batch(self, bs: int, num_kv_heads: int, device: torch.device) -> bool:
        """Fewer (request, KV head) pairs than SMs: chunks must be short to fill the GPU. On
        the CPU interpreter, never (the tests choose their split lengths)."""
        return device.type == "cuda" and bs * num_kv_heads <= sm_count(device)

    def _split_cap(self, bs: int, num_kv_heads: int, device: torch.device) -> int:
        """Chunks per request the decode grid allows, a function of the batch size alone: a
        power of two (few kernel variants) for bs * num_kv_heads * chunks programs to cover
        the GPU's SMs twice, and at least 8. On an H200 (bf16, 32/8 heads of 128, contexts of
        1K-32K, batches 1-256) this came within 7% of the best cap for every shape tried,
        where one chunk for large batches lost up to 22%. The CPU interpreter has no SMs to
        fill: max_kv_splits, at most INTERPRETER_MAX_SPLITS, which the tests rely on."""
        if device.type != "cuda":
            return min(self.max_kv_splits, INTERPRETER_MAX_SPLITS)
        wanted = next_pow2(triton.cdiv(2 * sm_count(device), bs * num_kv_heads))
        return max(1, min(self.max_kv_splits, max(8, wanted)))

    def _decode_workspace(
        self, bs: int, num_heads: int, head_dim: int, device: torch.device
    ) -> _SplitScratch:
        sc = self._scratch
        if (
            sc is None
            or sc.max_batch_size < bs
            or sc.num_heads != num_heads
            or sc.head_dim != head_dim
            or sc.out.device != device
        ):
            capacity = max(bs, 2 * sc.max_batch_size if sc is not None else 8)
            # split caps only fall with more KV heads: one KV head bounds every model's
            rows = max(b * self._split_cap(b, 1, device) for b in range(1, capacity + 1))
            sc = _SplitScratch(
                out=torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device),
                lse=torch.empty(rows * num_heads, dtype=torch.float32, device=device),
                max_batch_size=capacity,
                num_heads=num_heads,
                head_dim=head_dim,
            )
            self._scratch = sc
        return sc

    def _splits(self, bs: int, device: torch.device) -> torch.Tensor:
        buf = self._splits_buf
        if buf is None or buf.shape[0] < bs or buf.device != device:
            capacity = max(bs, 2 * buf.shape[0] if buf is not None else 8)
            buf = torch.ones(capacity, dtype=torch.int32, device=device)
            self._splits_buf = buf
        return buf[:bs]
