"""TritonBackend against TorchRefBackend: the same attention for EXTEND (cached prefixes) and
DECODE batches, the same pool contents, and the same greedy tokens from a tiny Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.fp8_kv import quantize_kv, store_into
from services.executor.attention import AttentionBackend, get_backend
from services.executor.attention.torch_ref import TorchRefBackend
from services.executor.attention.triton_backend import TritonBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.model_config import ModelConfig
from services.executor.weights import load_model
from tests.executor.helpers import BatchDriver, write_tiny_model
from tests.kernels.helpers import (
    DEVICE,
    FP8_KV_DTYPES,
    TOLERANCES,
    Tol,
    assert_same_bits,
    kernel_device,
    randn,
    spread_params,
)


def make_batch(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    kv_dtype: torch.dtype | None = None,
) -> ForwardBatch:
    """Requests on shuffled slots of a pool full of large junk; prefixes hold random K/V.
    kv_dtype: the pool's dtype (default `dtype`)."""
    total = sum(prefix_lens) + sum(extend_lens)
    kv_dtype = kv_dtype or dtype
    pool = KVPool(total + 9, num_layers, num_kv_heads, head_dim, kv_dtype, DEVICE)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(quantize_kv(randn(*buf.shape, dtype=dtype, gen=gen, scale=100.0), kv_dtype))
    table = ReqToTokenPool(len(prefix_lens) + 2, max(prefix_lens) + max(extend_lens) + 3, DEVICE)
    perm = torch.randperm(total + 9, generator=gen).tolist()
    new_locs, rows = [], []
    for p, e in zip(prefix_lens, extend_lens, strict=True):
        own, perm = perm[: p + e], perm[p + e :]
        row = table.allocate()
        table.write(row, 0, own)
        for buf in (*pool.k_buffers, *pool.v_buffers):
            prefix = torch.tensor(own[:p], dtype=torch.int64, device=DEVICE)
            store_into(buf, prefix, randn(p, num_kv_heads, head_dim, dtype=dtype, gen=gen))
        new_locs += own[p:]
        rows.append(row)
    table.flush()
    n = sum(extend_lens)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    return ForwardBatch(
        mode=mode,
        input_ids=tensor([0] * n),
        positions=tensor([0] * n),  # unused by attention
        out_cache_loc=tensor(new_locs),
        req_rows=tensor(rows),
        seq_lens=tensor([p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]),
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        kv_pool=pool,
        req_to_token=table,
    )


def clone_pool(batch: ForwardBatch) -> ForwardBatch:
    pool = batch.kv_pool
    twin = KVPool(pool.num_slots, len(pool.k_buffers), 1, 1, pool.dtype, DEVICE)
    twin.k_buffers = [b.clone() for b in pool.k_buffers]
    twin.v_buffers = [b.clone() for b in pool.v_buffers]
    return ForwardBatch(**{**batch.__dict__, "kv_pool": twin})


CASES = [
    (ForwardMode.EXTEND, [0, 0], [5, 1]),
    (ForwardMode.EXTEND, [3, 0, 300], [4, 40, 1]),
    (ForwardMode.EXTEND, [0, 7, 1, 0, 2, 9, 0, 33], [1, 2, 8, 3, 1, 1, 17, 2]),
    (ForwardMode.DECODE, [0, 4, 299, 1], [1, 1, 1, 1]),
    (ForwardMode.DECODE, [12], [1]),
    (ForwardMode.DECODE, [5, 1, 70, 2, 0, 33, 64, 8], [1] * 8),
]


HEADS = [
    pytest.param(4, 4, 16, torch.float32, id="mha-d16-fp32"),
    pytest.param(8, 2, 13, torch.float32, id="gqa4-d13-fp32"),
    pytest.param(4, 1, 64, torch.float16, id="gqa4-d64-fp16"),
]


# the interpreter runs each case with one head configuration, each meeting an extend and a
# decode (spread_params); a GPU runs the cross
@pytest.mark.parametrize(
    ("mode", "prefix_lens", "extend_lens", "num_heads", "num_kv_heads", "head_dim", "dtype"),
    spread_params(CASES, HEADS, ids=[f"{c[0].value}-bs{len(c[1])}-max{max(c[1])}" for c in CASES]),
)
def test_matches_torch_backend(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    attn: dict[str, float | int | None] | None = None,
) -> None:
    """attn: the layer's scale, window and softcap (AttentionBackend.forward's keywords)."""
    # Chunks of 64 keys, up to 4: the 299-token decode takes several.
    backend = TritonBackend(max_kv_splits=4, min_split_len=64)
    check_against_torch(
        backend, mode, prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype,
        kv_dtype=kv_dtype, attn=attn,
    )  # fmt: skip


def check_against_torch(
    backend: AttentionBackend,
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    kv_dtype: torch.dtype | None = None,
    attn: dict[str, Any] | None = None,
    tol: Tol | None = None,
) -> None:
    """Two layers of `backend` against TorchRefBackend on a copy of the same pool: the same
    outputs (within `tol`, default TOLERANCES[dtype]) and the same bytes stored. The forward's
    metadata is built once, before layer 0, and shared by both layers."""
    attn = attn or {}
    gen = torch.Generator().manual_seed(sum(prefix_lens) * 10 + num_heads + head_dim)
    batch = make_batch(
        mode, prefix_lens, extend_lens, 2, num_kv_heads, head_dim, dtype, gen, kv_dtype
    )
    twin = clone_pool(batch)
    torch_backend = TorchRefBackend()
    backend.init_forward_metadata(batch)
    torch_backend.init_forward_metadata(twin)
    n = sum(extend_lens)
    for layer in range(2):
        q = randn(n, num_heads, head_dim, dtype=dtype, gen=gen)
        k = randn(n, num_kv_heads, head_dim, dtype=dtype, gen=gen)
        v = randn(n, num_kv_heads, head_dim, dtype=dtype, gen=gen)
        got = backend.forward(q, k, v, layer, batch, **attn)
        want = torch_backend.forward(q, k, v, layer, twin, **attn)
        assert got.shape == q.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **(tol or TOLERANCES[dtype]))
        pool, twin_pool = batch.kv_pool, twin.kv_pool
        assert_same_bits(pool.k_buffers[layer], twin_pool.k_buffers[layer])
        assert_same_bits(pool.v_buffers[layer], twin_pool.v_buffers[layer])


# fp8 pools (--kv-cache-dtype): (num_heads, num_kv_heads, head_dim, dtype, kv_dtype, id).
FP8_SHAPES = [
    (8, 2, 13, torch.float32, torch.float8_e5m2, "gqa4-d13-fp32-e5m2"),
    (4, 1, 64, torch.float16, torch.float8_e4m3fn, "gqa4-d64-fp16-e4m3"),
    (8, 2, 128, torch.bfloat16, torch.float8_e4m3fn, "gqa4-d128-bf16-e4m3"),
]
# Every case with every shape on a GPU; on the CPU one of the first two per case, in turn.
FP8_CASES = [
    pytest.param(
        *case,
        *shape[:5],
        marks=() if j == i % 2 else (pytest.mark.gpu,),
        id=f"{shape[5]}-{case[0].value}-bs{len(case[1])}-max{max(case[1])}",
    )
    for i, case in enumerate(CASES)
    for j, shape in enumerate(FP8_SHAPES)
]


@pytest.mark.parametrize(
    (
        "mode",
        "prefix_lens",
        "extend_lens",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "kv_dtype",
    ),
    FP8_CASES,
)
def test_fp8_pool_matches_torch_backend(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> None:
    """store_kv writes the bytes KVPool.set_kv writes, and both backends widen them alike."""
    test_matches_torch_backend(
        mode, prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype, kv_dtype
    )


# Gemma's layers: a sliding window (smaller than, equal to and larger than the contexts), a
# softcap and a scale of their own, on EXTEND batches with cached prefixes and DECODE ones.
WINDOW_CASES = [
    pytest.param(CASES[1], {"window": 5, "softcap": 3.0, "scale": 0.2}, id="extend-w5-cap"),
    pytest.param(CASES[2], {"window": 9, "softcap": None, "scale": 0.4}, id="extend-w9"),
    pytest.param(CASES[2], {"window": 1000, "softcap": 3.0, "scale": None}, id="extend-wbig-cap"),
    pytest.param(CASES[3], {"window": 5, "softcap": 3.0, "scale": 0.2}, id="decode-w5-cap"),
    pytest.param(CASES[5], {"window": 34, "softcap": None, "scale": None}, id="decode-w34"),
]


@pytest.mark.parametrize(("case", "attn"), WINDOW_CASES)
def test_window_and_softcap_match_torch_backend(
    case: tuple[ForwardMode, list[int], list[int]], attn: dict[str, float | int | None]
) -> None:
    test_matches_torch_backend(*case, 8, 2, 13, torch.float32, attn=attn)


def test_registered_and_decode_buffers_persist() -> None:
    backend = get_backend("triton")
    assert isinstance(backend, TritonBackend)
    backend.reserve_decode(max_batch_size=8, num_heads=4, head_dim=16, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    for bs in (3, 8, 1):
        batch = make_batch(ForwardMode.DECODE, [4] * bs, [1] * bs, 1, 2, 16, torch.float32, gen)
        backend.init_forward_metadata(batch)
        q = randn(bs, 4, 16, dtype=torch.float32, gen=gen)
        k = randn(bs, 2, 16, dtype=torch.float32, gen=gen)
        backend.forward(q, k, k, 0, batch)
        scratch, splits = backend._scratch, backend._splits_buf
        assert scratch is not None and scratch.max_batch_size == 8
        assert splits is not None and splits.shape == (8,)
        if bs == 3:
            first = (scratch.out.data_ptr(), splits.data_ptr())
        assert (scratch.out.data_ptr(), splits.data_ptr()) == first


def greedy_with_prefix_reuse(
    model: torch.nn.Module, config: ModelConfig, prompts: list[list[int]], steps: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill every prompt in two chunks (the second one attends to a cached prefix), then
    decode greedily: `steps` tokens, the first from the prefill's logits, each later one from
    a decode step's. Returns the tokens and the prefill's logits."""
    driver = BatchDriver(model, config, max_reqs=len(prompts), device=str(DEVICE))
    rows = [driver.new_request() for _ in prompts]
    driver.extend(rows, [p[: len(p) // 2] for p in prompts])
    logits = driver.extend(rows, [p[len(p) // 2 :] for p in prompts])
    first_logits = logits
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        tokens = logits.argmax(-1).tolist()
        for out, t in zip(outputs, tokens, strict=True):
            out.append(t)
        if step + 1 < steps:  # the last token's decode step: logits no token is taken from
            logits = driver.decode(rows, tokens)
    return outputs, first_logits


def test_tiny_llama_greedy_tokens_match(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "llama")
    prompts = [[5, 9, 200, 17, 3, 88, 41], [260, 72, 101, 108], [7] * 23, [1, 2]]
    results = {}
    for backend in ("torch", "triton"):
        model, config = load_model(path, device=DEVICE, attention_backend=backend)
        results[backend] = greedy_with_prefix_reuse(model, config, prompts, steps=3)
    assert results["triton"][0] == results["torch"][0]
    torch.testing.assert_close(results["triton"][1], results["torch"][1], atol=1e-4, rtol=1e-4)


def test_tiny_gemma2_greedy_tokens_match(tmp_path: Path) -> None:
    """Gemma 2's window (8), softcap and scale reach the kernels as the torch backend gets
    them: the first prompt outgrows the window in its prefill and again while decoding."""
    path = write_tiny_model(tmp_path, "gemma2")
    prompts = [[5, 9, 200, 17, 3, 88, 41, 7, 7, 1, 2, 3, 4, 5], [260, 72, 101, 108]]
    results = {}
    for backend in ("torch", "triton"):
        model, config = load_model(path, device=DEVICE, attention_backend=backend)
        results[backend] = greedy_with_prefix_reuse(model, config, prompts, steps=4)
    assert results["triton"][0] == results["torch"][0]
    torch.testing.assert_close(results["triton"][1], results["torch"][1], atol=1e-4, rtol=1e-4)


def next_decode_step(
    batch: ForwardBatch,
    new_lens: list[int],
    inputs: tuple[torch.Tensor, ...],
    gen: torch.Generator,
) -> ForwardBatch:
    """Write the next decode step of a captured batch into its own tensors, as a CUDA graph
    replay sees it: new sequence lengths, each request's slot at its new last position, new
    `inputs` (q, k, v); returns a twin batch, on a copy of the pool, for the reference."""
    table = batch.req_to_token.req_to_token
    rows = batch.req_rows.tolist()
    batch.seq_lens.copy_(torch.tensor(new_lens))
    locs = [int(table[row, n - 1]) for row, n in zip(rows, new_lens, strict=True)]
    batch.out_cache_loc.copy_(torch.tensor(locs))
    for t in inputs:
        t.copy_(randn(*t.shape, dtype=t.dtype, gen=gen))
    twin = clone_pool(batch)
    twin.prefix_lens_cpu = [n - 1 for n in new_lens]
    twin.seq_lens = batch.seq_lens.clone()
    twin.out_cache_loc = batch.out_cache_loc.clone()
    return twin


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, *FP8_KV_DTYPES])
def test_decode_replays_in_a_cuda_graph(kv_dtype: torch.dtype | None) -> None:
    """Capture init_forward_metadata + forward of one decode batch (as the model's forward
    runs them), then replay for other sequence lengths and inputs written into the same
    tensors, as services/executor/cuda_graph.py does: the split counts are recomputed by the
    graph itself from the new seq_lens."""
    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim, dtype = 8, 2, 64, torch.bfloat16
    batch = make_batch(
        ForwardMode.DECODE, [40, 300, 7], [1, 1, 1], 1, num_kv_heads, head_dim, dtype, gen, kv_dtype
    )
    backend = TritonBackend(max_kv_splits=8, min_split_len=32)
    backend.reserve_decode(max_batch_size=4, num_heads=num_heads, head_dim=head_dim, device=DEVICE)
    q = randn(3, num_heads, head_dim, dtype=dtype, gen=gen)
    k = randn(3, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = randn(3, num_kv_heads, head_dim, dtype=dtype, gen=gen)

    def step() -> torch.Tensor:
        backend.init_forward_metadata(batch)
        return backend.forward(q, k, v, 0, batch)

    step()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    # The next "step": shorter contexts (other split counts), new q/k/v, new slots.
    twin = next_decode_step(batch, [33, 129, 1], (q, k, v), gen)
    graph.replay()
    want = TorchRefBackend().forward(q, k, v, 0, twin)
    torch.testing.assert_close(out, want, **TOLERANCES[dtype])
    assert_same_bits(batch.kv_pool.k_buffers[0], twin.kv_pool.k_buffers[0])
    assert_same_bits(batch.kv_pool.v_buffers[0], twin.kv_pool.v_buffers[0])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e5m2], ids=["bf16", "e5m2"])
def test_a_packed_batch_splits_into_long_chunks(kv_dtype: torch.dtype | None) -> None:
    """64 requests with Llama-3.1-8B's heads (32 / 8 of 128): a program reads 4 KV heads, so
    each context splits into chunks of packed_split_len keys (1,024) rather than
    min_split_len's 256, and the attention still matches the torch backend's."""
    prefix_lens = [1500 + 37 * i for i in range(64)]  # 1,500 to 3,831 keys
    backend = TritonBackend()
    check_against_torch(
        backend, ForwardMode.DECODE, prefix_lens, [1] * 64, 32, 8, 128, torch.bfloat16,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    meta = backend._meta
    assert meta is not None and meta.kv_pack == 4 and meta.num_kv_splits is not None
    want = [min(meta.split_cap, -(-(p + 1) // backend.packed_split_len)) for p in prefix_lens]
    assert meta.num_kv_splits.tolist() == want
    assert max(want) > 1  # the chunks do split these contexts


def test_tiny_qwen3_with_the_pool_store_fused_into_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layers' CUDA path (run in the interpreter where there is no GPU): the rotation's
    launch norms q/k and writes K/V to the pool (KVStore), and the backend stores nothing
    more. Same greedy tokens and close logits as the torch backend's own store."""
    from kernels import store_kv
    from services.executor.attention import triton_backend
    from services.executor.models import layers

    path = write_tiny_model(tmp_path, "qwen3")
    prompts = [[5, 9, 200, 17, 3, 88, 41], [260, 72, 101, 108], [7] * 23, [1, 2]]
    model, config = load_model(path, device=DEVICE, attention_backend="torch")
    want = greedy_with_prefix_reuse(model, config, prompts, steps=2)
    kernel_device(monkeypatch, layers)
    stores: list[int] = []

    def no_separate_store(**kwargs: object) -> None:
        stores.append(1)
        store_kv.store_kv(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "store_kv", no_separate_store)
    model, config = load_model(path, device=DEVICE, attention_backend="triton")
    got = greedy_with_prefix_reuse(model, config, prompts, steps=2)
    assert stores == []  # every layer's K/V went in with its rotation
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


def test_split_caps_on_a_gpu_and_the_scratch_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU of 132 SMs (an H100), 8 KV heads: one request splits 64 ways, two 32, eight
    or more 8 (the floor); a step's workspace is a contiguous [bs, heads, cap] view of the
    flat scratch, so a 64-way split of one request needs no 64 chunks for every row."""
    from services.executor.attention import triton_backend

    backend = TritonBackend()
    monkeypatch.setattr(triton_backend, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")  # only its type is read
    assert [backend._split_cap(bs, 8, gpu) for bs in (1, 2, 4, 8, 256)] == [64, 32, 16, 8, 8]
    backend.reserve_decode(max_batch_size=8, num_heads=4, head_dim=16, device="cpu")
    scratch = backend._scratch
    # on the CPU every cap is INTERPRETER_MAX_SPLITS (32): the interpreter runs chunks serially
    assert scratch is not None and scratch.out.numel() == 8 * 32 * 4 * 16
    ws = scratch.view(3, 32)
    assert ws.partial_out.shape == (3, 4, 32, 16) and ws.partial_out.is_contiguous()
    assert (
        ws.partial_lse.shape == (3, 4, 32) and ws.partial_out.data_ptr() == scratch.out.data_ptr()
    )
