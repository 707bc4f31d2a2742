"""The FlashInfer attention backend (`--attention-backend flashinfer`, `pip install
radixserve[flashinfer]`): FlashInfer's paged prefill and decode kernels over the same pool,
request table and radix cache as the Triton backend.

The pool is FlashInfer's NHD paged cache with pages of one slot: K of layer l is
`k_buffers[l]` viewed as [slots, 1, kv_heads, head_dim]. A request's pages are its row of the
request table, gathered on the device into `kv_indices` (kernels/flat_slots.py), so nothing
is read back to the host; `kv_indptr` comes from the host's own sequence lengths.

FlashInfer splits every call in two: `plan` (host work: the split schedule for these lengths,
copied to the device) and `run` (the kernels). A forward plans once per kind of layer (sliding
window, softcap, scale: Gemma has two kinds), at the first layer of that kind, and reuses the
plan for the others. Decode uses FlashInfer's tensor-core kernels, which measured faster at
every shape of issue 24's table (GQA groups of 4, `loadtest/gpu/flashinfer_attn.py`).

A prefill whose requests bring many new tokens each (compute-bound attention) runs on
FlashInfer's ragged kernel instead, over each request's context K/V gathered from the pool
into contiguous scratch once per layer: the ragged kernel loads contiguous keys with the
tensor memory accelerator, the paged one gathers every key's row itself. Measured on an H100
(Llama-3.1-8B's attention, `loadtest/results/gpu_ttft100k_h100_run1.json`): 16,384 new tokens
over a cached prefix of 16K-84K, the paged kernel ran at 540-546 TFLOP/s, the ragged kernel
over the chunk's own keys at 698; the gathering is a copy of the context, small beside
attention that reads each key for thousands of queries.

CUDA graphs: a decode graph of batch size bs is captured over wrappers of that size whose
tables live in fixed buffers (FlashInfer's `use_cuda_graph`); the slot gathering is captured
with the kernels, and before each replay `prepare_replay` plans those wrappers for the real
sequence lengths (host work the graph cannot hold).

Plans never read the device: every table a plan takes from the host is a host tensor (a
device one is read back with a sync, which would stall the overlapped loop until the device
finished the step before). A plan's schedule reaches the device by a copy from the wrapper's
pinned buffer queued on the stream, so a wrapper planned again waits until the device has
taken its last plan's copy (an event), never for the step itself.

A graph's wrapper is planned in full once; before later replays only its schedule is
recomputed, by FlashInfer's own compiled planner over the host's lengths (`_replan`).
FlashInfer's Python `plan` spends most of its time outside that planner: it takes the
longest context with Python's `max` over a tensor, one element at a time (0.8 ms for 256
requests on a 2026 x86 core), and re-resolves the compiled module. The wrapper's attributes
this reaches into are FlashInfer 0.5's, so the short path is taken only on 0.5.x
(`REPLAN_VERSIONS`); any other version plans in full every time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from kernels.flat_slots import flat_slots, kv_indptr
from kernels.store_kv import store_kv
from services.executor.attention import AttentionBackend, pool_buffers
from services.executor.forward_batch import ForwardBatch, ForwardMode

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's split-KV scratch; its docs suggest 128 MiB
# The gathered extend: taken when requests bring at least this many new tokens each on average
# (the copy of a context is then under a few percent of its attention), into scratch of at
# most this many bytes for K and V together (a 100,000-token context of Llama-3.1-8B: 400 MiB).
DENSE_MIN_NEW_TOKENS = 1024
DENSE_MAX_BYTES = 512 * 2**20
# Head dims FlashInfer's prefill and decode kernels dispatch (64 / 128 / 256): others fail in the
# kernel ("Invalid configuration" for 16) or were never tried here.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
# FlashInfer versions whose decode wrapper `_replan` knows (its attributes and planner's arguments)
REPLAN_VERSIONS = ("0.5.",)
# (window, softcap, scale) of a kind of layer
LayerKind = tuple[int, float, float]


def load_flashinfer() -> Any:
    """The flashinfer module, or an ImportError that says how to install it."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "--attention-backend flashinfer needs FlashInfer: pip install 'radixserve[flashinfer]' "
            f"(flashinfer-python; it compiles its kernels with nvcc on first use): {e}"
        ) from e
    return flashinfer


class FlashInferBackend(AttentionBackend):
    def __init__(
        self,
        dense_min_new_tokens: int = DENSE_MIN_NEW_TOKENS,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        self.fi = load_flashinfer()
        self.dense_min_new_tokens = dense_min_new_tokens
        self.dense_max_bytes = dense_max_bytes
        self._workspace: torch.Tensor | None = None
        self._batch: ForwardBatch | None = None
        self._indptr_host: torch.Tensor | None = None  # [bs + 1] int32, this forward's
        self._indices: torch.Tensor | None = None  # int32 slots of this forward
        self._ones: torch.Tensor | None = None  # the graphs' last_page_len: pages of one slot
        self._ones_host: torch.Tensor | None = None  # the same on the host, for plans
        self._dense = False  # this forward is an extend over gathered K/V
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # gathered K, V
        self._planned: dict[LayerKind, Any] = {}  # this forward's planned wrappers
        self._eager: dict[tuple[str, LayerKind], Any] = {}
        self._plan_done: dict[int, torch.cuda.Event] = {}  # id(wrapper): its last plan's copy
        self._seq_lens_host: torch.Tensor | None = None  # [bs] int32, this forward's
        self._max_seq_len = 0
        self._replannable: set[int] = set()  # id(wrapper): graph wrappers planned in full once
        version = str(getattr(self.fi, "__version__", ""))
        self._can_replan = version.startswith(REPLAN_VERSIONS)
        # CUDA graphs: the batch size being captured, fixed tables, a wrapper per size and kind
        self._capture_bs: int | None = None
        self._g_indptr: torch.Tensor | None = None
        self._g_indices: torch.Tensor | None = None
        self._graph: dict[tuple[int, LayerKind], Any] = {}
        self._shape: tuple[int, int, int, torch.dtype, torch.dtype] | None = None

    # -- CUDA graphs (services/executor/cuda_graph.py) --------------------------------------

    def reserve_decode(
        self, *, max_batch_size: int, num_heads: int, head_dim: int, device: torch.device | str
    ) -> None:
        """The fixed [max_batch_size + 1] indptr the decode graphs read (the slot buffer,
        max_batch_size rows of the slot table's width, is made at the first capture)."""
        dev = torch.empty(0, device=device).device
        self._g_indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev)
        self._ensure_ones(max_batch_size, dev)

    def prepare_capture(self, bs: int | None) -> None:
        """Decode forwards from now on are the warm-up and capture of the graph of size `bs`
        (None: capturing is over)."""
        self._capture_bs = bs

    def prepare_replay(self, bs: int, seq_lens: list[int]) -> None:
        """Plan the graph of size `bs` for these sequence lengths (padding rows included)."""
        self._set_lens(seq_lens)
        for (size, kind), wrapper in self._graph.items():
            if size == bs:
                self._plan_decode(wrapper, kind)

    # -- a forward --------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        table = batch.req_to_token.req_to_token
        self._batch, self._planned = batch, {}
        seq_lens_cpu = batch.seq_lens_cpu
        self._set_lens(seq_lens_cpu)
        graph_bs = self._capture_bs if batch.mode is ForwardMode.DECODE else None
        if graph_bs is not None:
            # Captured: the gathering reads the static seq_lens, writes the fixed buffers.
            assert self._g_indptr is not None, "reserve_decode before capturing"
            if self._g_indices is None:
                # Every row of the largest graph at the table's full width. Not the pool's
                # slot count: requests sharing a cached prefix each list its slots, so their
                # lengths may add up to several times the pool (1,024 requests of a shared
                # 2,048-token system prompt, 512 decoding at once: 1.2M listed slots of a
                # 424K-slot pool), and the gathering would write past the buffer.
                rows = self._g_indptr.shape[0] - 1
                self._g_indices = torch.zeros(
                    rows * table.shape[1], dtype=torch.int32, device=device
                )
            indptr = kv_indptr(batch.seq_lens, out=self._g_indptr[: graph_bs + 1])
            out, width = self._g_indices, table.shape[1]
        else:
            indptr = kv_indptr(batch.seq_lens)
            out = torch.empty(int(sum(seq_lens_cpu)), dtype=torch.int32, device=device)
            width = self._max_seq_len
        self._indices = flat_slots(
            req_to_token=table, req_rows=batch.req_rows, indptr=indptr, max_len=width, out=out
        )
        self._ensure_ones(batch.batch_size, device)
        self._dense = batch.mode is ForwardMode.EXTEND and self._dense_extend(batch)

    def _dense_extend(self, batch: ForwardBatch) -> bool:
        """Whether this prefill gathers its contexts' K/V (see the module's docstring): many
        new tokens a request, and scratch within `dense_max_bytes`."""
        new = sum(batch.extend_lens_cpu)
        if new < self.dense_min_new_tokens * max(1, batch.batch_size):
            return False
        k0 = batch.kv_pool.k_buffers[0]
        tokens = int(sum(batch.seq_lens_cpu))
        row_bytes = k0[0].numel() * k0.element_size()
        if 2 * tokens * row_bytes > self.dense_max_bytes:
            return False
        sc = self._scratch
        if sc is None or sc[0].shape[0] < tokens or sc[0].shape[1:] != k0.shape[1:]:
            grown = max(tokens, 2 * sc[0].shape[0] if sc is not None else 0)
            rows = min(self.dense_max_bytes // (2 * row_bytes), grown)
            self._scratch = sc = None  # the old scratch's memory is free for the new
            try:
                self._scratch = (
                    torch.empty((rows, *k0.shape[1:]), dtype=k0.dtype, device=k0.device),
                    torch.empty((rows, *k0.shape[1:]), dtype=k0.dtype, device=k0.device),
                )
            except torch.cuda.OutOfMemoryError:
                # The KV pool and activations took the memory: the paged kernel needs none.
                mib = 2 * rows * row_bytes / 2**20
                log.warning("no memory for %.0f MiB of prefill scratch: prefill reads pages", mib)
                self.dense_max_bytes = 0
                return False
        return True

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
        if self._batch is not batch:
            self.init_forward_metadata(batch)
        k_buffer = batch.kv_pool.k_buffers[layer_id]
        v_buffer = batch.kv_pool.v_buffers[layer_id]
        if k_buffer.dtype != q.dtype:
            raise ValueError(
                f"--attention-backend flashinfer runs a {q.dtype} model over a cache of the "
                f"same dtype, not {k_buffer.dtype}: use the triton backend for an fp8 cache"
            )
        if not kv_stored:
            loc = batch.out_cache_loc
            store_kv(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, out_cache_loc=loc)
        num_heads, head_dim = q.shape[1], q.shape[2]
        kind: LayerKind = (
            window or 0,
            softcap or 0.0,
            scale if scale is not None else 1.0 / math.sqrt(head_dim),
        )
        self._shape = (num_heads, k_buffer.shape[1], head_dim, q.dtype, k_buffer.dtype)
        wrapper = self._planned.get(kind)
        if wrapper is None:
            wrapper = self._wrapper_for(batch, kind)
            self._planned[kind] = wrapper
        if self._dense:
            assert self._scratch is not None and self._indices is not None
            n = self._indices.shape[0]
            k_all, v_all = self._scratch[0][:n], self._scratch[1][:n]
            torch.index_select(k_buffer, 0, self._indices, out=k_all)
            torch.index_select(v_buffer, 0, self._indices, out=v_all)
            dense: torch.Tensor = wrapper.run(q.contiguous(), k_all, v_all)
            return dense
        pages = (
            k_buffer.view(k_buffer.shape[0], 1, k_buffer.shape[1], head_dim),
            v_buffer.view(v_buffer.shape[0], 1, v_buffer.shape[1], head_dim),
        )
        out: torch.Tensor = wrapper.run(q.contiguous(), pages)
        return out

    def fused_kv_store(
        self, layer_id: int, batch: ForwardBatch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pool's buffers: the rotary kernel may write the new K/V itself."""
        return pool_buffers(layer_id, batch, dtype)

    # -- wrappers and plans -----------------------------------------------------------------

    def _wrapper_for(self, batch: ForwardBatch, kind: LayerKind) -> Any:
        """This forward's wrapper for layers of `kind`, planned (except inside a capture,
        where the warm-up of the same batch planned it and the replay plans again)."""
        ws = self._workspace_on(batch.seq_lens.device)
        if batch.mode is ForwardMode.EXTEND:
            name = "ragged" if self._dense else "paged"
            wrapper = self._eager.get((name, kind))
            if wrapper is None:
                if self._dense:
                    wrapper = self.fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
                else:
                    wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                self._eager[(name, kind)] = wrapper
            self._plan_extend(wrapper, kind, batch)
            return wrapper
        bs = self._capture_bs
        if bs is None:
            wrapper = self._eager.get(("decode", kind))
            if wrapper is None:
                wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=True
                )
                self._eager[("decode", kind)] = wrapper
            self._plan_decode(wrapper, kind)
            return wrapper
        wrapper = self._graph.get((bs, kind))
        if wrapper is None:
            assert self._g_indptr is not None and self._g_indices is not None
            assert self._ones is not None
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._g_indptr[: bs + 1],
                paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._ones[:bs],
            )
            self._graph[(bs, kind)] = wrapper
        if not torch.cuda.is_current_stream_capturing():
            self._plan_decode(wrapper, kind)
        return wrapper

    def _plan(self, wrapper: Any, plan: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """plan(*args, **kwargs) for `wrapper` (its full plan or `_replan`), once the device has
        taken the wrapper's last plan (its pinned buffer is rewritten here); then an event
        marks this plan's copy."""
        done = self._plan_done.get(id(wrapper))
        if done is not None:
            done.synchronize()
        plan(*args, **kwargs)
        event = torch.cuda.Event()
        event.record()
        self._plan_done[id(wrapper)] = event

    def _plan_decode(self, wrapper: Any, kind: LayerKind) -> None:
        assert self._shape is not None and self._indptr_host is not None
        assert self._indices is not None and self._ones_host is not None
        heads, kv_heads, dim, q_dtype, kv_dtype = self._shape
        window, softcap, scale = kind
        bs = self._indptr_host.shape[0] - 1
        in_graph = getattr(wrapper, "is_cuda_graph_enabled", False)
        if id(wrapper) in self._replannable:
            self._plan(wrapper, self._replan, wrapper, heads, kv_heads, dim, window)
            return
        self._plan(
            wrapper,
            wrapper.plan,
            self._indptr_host,
            # A graph's wrapper reads the slots its captured gathering writes: copy none.
            self._indices[:0] if in_graph else self._indices,
            self._ones_host[:bs],
            heads,
            kv_heads,
            dim,
            1,
            window_left=window - 1 if window else -1,
            logits_soft_cap=softcap or None,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
            sm_scale=scale,
        )
        if in_graph and self._can_replan:
            self._replannable.add(id(wrapper))

    def _replan(self, wrapper: Any, heads: int, kv_heads: int, dim: int, window: int) -> None:
        """A graph wrapper's schedule for new lengths, everything else as its full plan left
        it (the same batch size, kind and dtypes: a graph's wrapper is made for one of each).
        What FlashInfer 0.5's `plan` does for tensor-core decode with pages of one slot,
        less the work that does not change between replays; its other arguments are those
        of that `plan`: total rows = requests (one query each), page size 1, CUDA graph on,
        not causal, no fixed split size, split-KV allowed, no colocated CTAs."""
        assert self._indptr_host is not None and self._seq_lens_host is not None
        bs = self._seq_lens_host.shape[0]
        wrapper._paged_kv_indptr_buf.copy_(self._indptr_host, non_blocking=True)
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer,
            wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer,
            _arange_host(bs + 1),  # one query a request
            self._indptr_host,
            self._seq_lens_host,
            bs,
            bs,
            heads,
            kv_heads,
            1,
            True,
            dim,
            dim,
            False,
            window - 1 if window else -1,
            -1,
            False,
            0,
        )
        wrapper._max_kv_len = self._max_seq_len

    def _set_lens(self, seq_lens: list[int]) -> None:
        """This forward's lengths as the plans take them: indptr, lengths, the longest."""
        self._seq_lens_host = torch.tensor(seq_lens, dtype=torch.int32)
        self._indptr_host = _indptr_of(self._seq_lens_host)
        self._max_seq_len = max(seq_lens, default=0)

    def _plan_extend(self, wrapper: Any, kind: LayerKind, batch: ForwardBatch) -> None:
        assert self._shape is not None and self._indptr_host is not None
        assert self._indices is not None and self._ones_host is not None
        heads, kv_heads, dim, q_dtype, kv_dtype = self._shape
        window, softcap, scale = kind
        # Ragged: the gathered K/V are the contexts back to back, as kv_indptr counts them.
        pages = () if self._dense else (self._indices, self._ones_host[: batch.batch_size])
        self._plan(
            wrapper,
            wrapper.plan,
            _indptr(batch.extend_lens_cpu),
            self._indptr_host,
            *pages,
            heads,
            kv_heads,
            dim,
            *(() if self._dense else (1,)),
            causal=True,
            window_left=window - 1 if window else -1,
            logits_soft_cap=softcap or None,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
            sm_scale=scale,
        )

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _ensure_ones(self, n: int, device: torch.device) -> None:
        if self._ones is None or self._ones.shape[0] < n:
            self._ones = torch.ones(max(n, 256), dtype=torch.int32, device=device)
            self._ones_host = torch.ones(max(n, 256), dtype=torch.int32).pin_memory()


def _indptr(lens: list[int]) -> torch.Tensor:
    """0, then the running sum of `lens`: [len(lens) + 1] int32 on the host."""
    return _indptr_of(torch.tensor(lens, dtype=torch.int32))


def _indptr_of(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    if lens.shape[0]:
        torch.cumsum(lens, 0, out=out[1:])
    return out


_ARANGE: dict[int, torch.Tensor] = {}


def _arange_host(n: int) -> torch.Tensor:
    """0..n-1 int32 on the host, made once per n (a planner only reads it)."""
    out = _ARANGE.get(n)
    if out is None:
        out = _ARANGE[n] = torch.arange(n, dtype=torch.int32)
    return out
