"""The request-to-slot table: writes are batched until the next flush, in order; the latent
(MLA) pool's layout and sizing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.executor.builder import CPU_DEFAULT_KV_TOKENS, EngineSettings, kv_pool_tokens
from services.executor.kv_pool import ReqToTokenPool, kv_bytes_per_token, make_kv_pool
from services.executor.model_config import ModelConfig
from shared.model_files import resolve_model
from tests.executor.helpers import write_tiny_model


def test_writes_reach_the_table_at_flush_in_one_scatter() -> None:
    table = ReqToTokenPool(max_reqs=3, max_context=8, device="cpu", pad_slot=99)
    a, b = table.allocate(), table.allocate()
    table.write(a, 0, [5, 6, 7])
    table.write(b, 2, [9])
    assert table.req_to_token[:3].eq(0).all()  # nothing written before the flush
    table.flush()
    assert table.req_to_token[a, :4].tolist() == [5, 6, 7, 0]
    assert table.req_to_token[b, :4].tolist() == [0, 0, 9, 0]
    assert table.req_to_token[table.pad_row].eq(99).all()


def test_a_later_write_to_the_same_row_wins() -> None:
    """The radix cache rewrites a prefix the request wrote before (switching it to the
    cache's copies): order must hold even within one flush."""
    table = ReqToTokenPool(max_reqs=2, max_context=6, device="cpu")
    row = table.allocate()
    for _ in range(50):  # a scatter with repeated indices would pick either value
        table.write(row, 0, [1, 2, 3, 4])
        table.write(row, 1, [20, 30])
        table.write(row, 4, [50])
        table.flush()
        assert table.req_to_token[row, :6].tolist() == [1, 20, 30, 4, 50, 0]
        table.req_to_token.zero_()


def test_flush_without_writes_is_free() -> None:
    table = ReqToTokenPool(max_reqs=1, max_context=4, device="cpu")
    before = table.req_to_token.clone()
    table.flush()
    assert torch.equal(table.req_to_token, before)


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3: 2 layers, latent 32 + rotated 8 per token, 4 heads of 12 + 8."""
    return write_tiny_model(tmp_path_factory.mktemp("mla"), "deepseek_v3")


@pytest.fixture(scope="module")
def latent_config(latent_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf_dir(latent_dir)


def test_the_pool_holds_one_latent_row_per_token_per_layer(latent_config: ModelConfig) -> None:
    config = latent_config
    # 2 layers x (32 + 8) elements, where K and V of 4 heads of 20 would take 2 x 2 x 4 x 20.
    assert kv_bytes_per_token(config, torch.float32) == 2 * 40 * 4
    assert kv_bytes_per_token(config, torch.bfloat16, kv_heads=2) == 2 * 40 * 2  # replicated
    assert kv_bytes_per_token(config, torch.float8_e4m3fn) == 2 * 40
    pool = make_kv_pool(config, 10, torch.float32, "cpu")
    assert pool.latent and pool.v_buffers == []
    assert [tuple(b.shape) for b in pool.k_buffers] == [(11, 1, 40)] * 2  # + the padding slot
    assert pool.nbytes() == 11 * kv_bytes_per_token(config, torch.float32)
    slots = pool.allocate(3)
    assert slots == [0, 1, 2] and pool.num_free() == 7
    rows = torch.arange(3 * 40, dtype=torch.float32).view(3, 1, 40)
    pool.set_latent(1, torch.tensor([2, 0, 1]), rows)
    assert torch.equal(pool.k_buffers[1][[2, 0, 1]], rows)
    assert pool.k_buffers[0].eq(0).all()  # the other layer untouched
    pool.free(slots)
    assert pool.num_free() == 10


def test_cpu_pool_gets_the_default_bytes_in_latent_rows(
    latent_dir: Path, latent_config: ModelConfig
) -> None:
    config = latent_config
    s = EngineSettings(model=resolve_model(str(latent_dir)), name="e", stream="s", device="cpu")
    fp32, fp8 = torch.float32, torch.float8_e5m2
    cpu = torch.device("cpu")
    assert kv_pool_tokens(s, config, fp32, fp32, cpu) == CPU_DEFAULT_KV_TOKENS
    assert kv_pool_tokens(s, config, fp32, fp8, cpu) == 4 * CPU_DEFAULT_KV_TOKENS


def test_slots_go_out_as_one_free_list_would_hand_them() -> None:
    """Returned slots first, the last returned first, then those never handed out in order:
    what one list of every slot, popped from the end, gave (the reference here)."""
    import random

    from services.executor.kv_pool import KVPool

    rng = random.Random(7)
    pool = KVPool(50, 0, 1, 1, torch.float32, "cpu")
    reference = list(range(49, -1, -1))
    held: list[int] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            back = rng.sample(held, rng.randint(1, len(held)))
            held = [s for s in held if s not in back]
            pool.free(back)
            reference.extend(back)
        else:
            n = rng.randint(0, 8)
            if n > len(reference):
                with pytest.raises(MemoryError, match="free slots"):
                    pool.allocate(n)
                continue
            want = reference[len(reference) - n :][::-1]
            del reference[len(reference) - n :]
            assert pool.allocate(n) == want
            held.extend(want)
        assert pool.num_free() == len(reference) and sorted(pool.free_slots()) == sorted(reference)
        assert pool.can_allocate(len(reference)) and not pool.can_allocate(len(reference) + 1)


def test_a_pool_of_ten_million_slots_holds_no_list_of_them() -> None:
    """A tiny model's rows on a large GPU are hundreds of millions of slots: the pool's
    bookkeeping must not grow with them (one list of every slot: 360 MB here)."""
    import tracemalloc

    from services.executor.kv_pool import KVPool

    tracemalloc.start()
    try:
        pool = KVPool(10_000_000, 0, 1, 1, torch.float32, "cpu")
        assert pool.allocate(3) == [0, 1, 2] and pool.num_free() == 9_999_997
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
