"""TritonBackend's latent attention (forward_mla) against TorchRefBackend's: a tiny DeepSeek
model's greedy tokens with prefix reuse, and (GPU) a decode replayed in a CUDA graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.executor.attention.torch_ref import TorchRefBackend
from services.executor.attention.triton_backend import TritonBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.weights import load_model
from tests.executor.helpers import write_tiny_model
from tests.kernels.helpers import DEVICE, TOLERANCES, assert_same_bits, randn
from tests.kernels.test_triton_backend import greedy_with_prefix_reuse


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("deepseek_v2", {}), ("deepseek_v3", {"q_lora_rank": 24})],
    ids=["v2-lite-shape", "v3-q-lora"],
)
def test_tiny_deepseek_greedy_tokens_match(
    tmp_path: Path, arch: str, overrides: dict[str, int]
) -> None:
    path = write_tiny_model(tmp_path, arch, **overrides)
    prompts = [[5, 9, 200, 17, 3, 88, 41], [260, 72, 101, 108], [7] * 23, [1, 2]]
    results = {}
    for backend in ("torch", "triton"):
        model, config = load_model(path, device=DEVICE, attention_backend=backend)
        results[backend] = greedy_with_prefix_reuse(model, config, prompts, steps=3)
    assert results["triton"][0] == results["torch"][0]
    torch.testing.assert_close(results["triton"][1], results["torch"][1], atol=1e-4, rtol=1e-4)


def latent_decode_batch(seq_lens: list[int], width: int, dtype: torch.dtype) -> ForwardBatch:
    gen = torch.Generator().manual_seed(3)
    total = sum(seq_lens)
    pool = KVPool(total + 5, 1, 1, width, dtype, DEVICE, values=False)
    pool.k_buffers[0].copy_(randn(total + 6, 1, width, dtype=dtype, gen=gen))
    table = ReqToTokenPool(len(seq_lens) + 1, max(seq_lens) + 1, DEVICE)
    perm = torch.randperm(total, generator=gen).tolist()
    rows, locs = [], []
    for n in seq_lens:
        own, perm = perm[:n], perm[n:]
        row = table.allocate()
        table.write(row, 0, own)
        rows.append(row)
        locs.append(own[-1])
    table.flush()

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    bs = len(seq_lens)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=tensor([0] * bs),
        positions=tensor([n - 1 for n in seq_lens]),
        out_cache_loc=tensor(locs),
        req_rows=tensor(rows),
        seq_lens=tensor(seq_lens),
        prefix_lens_cpu=[n - 1 for n in seq_lens],
        extend_lens_cpu=[1] * bs,
        kv_pool=pool,
        req_to_token=table,
    )


@pytest.mark.gpu
def test_mla_decode_replays_in_a_cuda_graph() -> None:
    """Capture init_forward_metadata + forward_mla of one decode batch, then replay it for
    other sequence lengths and inputs written into the same tensors."""
    heads, rank, rope, dtype = 16, 512, 64, torch.bfloat16
    batch = latent_decode_batch([40, 300, 7], rank + rope, dtype)
    backend = TritonBackend(max_kv_splits=8, min_split_len=32)
    backend.reserve_decode(max_batch_size=4, num_heads=heads, head_dim=rank, device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    q = randn(3, heads, rank + rope, dtype=dtype, gen=gen)
    latent = randn(3, 1, rank + rope, dtype=dtype, gen=gen)
    scale = (192) ** -0.5

    def step() -> torch.Tensor:
        backend.init_forward_metadata(batch)
        return backend.forward_mla(q, latent, 0, batch, scale, rank)

    step()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    new_lens = [33, 129, 1]
    table = batch.req_to_token.req_to_token
    batch.seq_lens.copy_(torch.tensor(new_lens))
    locs = [int(table[r, n - 1]) for r, n in zip(batch.req_rows.tolist(), new_lens, strict=True)]
    batch.out_cache_loc.copy_(torch.tensor(locs))
    q.copy_(randn(*q.shape, dtype=dtype, gen=gen))
    latent.copy_(randn(*latent.shape, dtype=dtype, gen=gen))
    pool = batch.kv_pool
    twin_pool = KVPool(pool.num_slots, 1, 1, rank + rope, dtype, DEVICE, values=False)
    twin_pool.k_buffers = [b.clone() for b in pool.k_buffers]
    twin = ForwardBatch(
        **{
            **batch.__dict__,
            "kv_pool": twin_pool,
            "prefix_lens_cpu": [n - 1 for n in new_lens],
            "seq_lens": batch.seq_lens.clone(),
            "out_cache_loc": batch.out_cache_loc.clone(),
        }
    )
    graph.replay()
    want = TorchRefBackend().forward_mla(q, latent, 0, twin, scale, rank)
    torch.testing.assert_close(out, want, **TOLERANCES[dtype])
    assert_same_bits(pool.k_buffers[0], twin_pool.k_buffers[0])
