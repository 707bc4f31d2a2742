"""Every integer table a step sends to the device starts on a 16-byte boundary, whatever the
batch's token and request counts: Triton compiles one kernel binary per combination of
aligned pointers, so a table whose alignment followed the batch shape made the first burst
after a start wait on a compile (the 1.5 s TTFT of a 64-request burst on an H100)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor.attention.triton_backend import TritonBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.packing import ALIGN_BYTES, pack_aligned
from tests.executor.helpers import write_tiny_model
from tests.executor.test_attention import make_batch
from tests.executor.test_engine import make_engine, make_request


def aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_every_table_is_aligned_and_holds_its_values(dtype: torch.dtype) -> None:
    tables = [[1, 2, 3], [4], [], [5, 6, 7, 8, 9], [10, 11]]
    views = pack_aligned(tables, dtype, torch.device("cpu"))
    assert [v.tolist() for v in views] == tables
    assert all(v.dtype == dtype for v in views)
    assert all(aligned(v) for v in views)
    # one copy: every view shares one storage
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1


def _int_tensors(batch: ForwardBatch) -> dict[str, torch.Tensor]:
    return {
        "input_ids": batch.input_ids,
        "positions": batch.positions,
        "out_cache_loc": batch.out_cache_loc,
        "req_rows": batch.req_rows,
        "seq_lens": batch.seq_lens,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("packing"), "llama", seed=3)


def test_step_inputs_are_aligned_for_odd_token_and_request_counts(model_dir: Path) -> None:
    """Batches of 1, 2, 3 and 6 requests with odd and even token counts: before, `req_rows`
    sat at an 8-byte offset whenever the step's token count was odd."""
    engine = make_engine(model_dir)
    built: list[ForwardBatch] = []
    build = engine.runner.batch_from

    def spy(*args: Any, **kw: Any) -> ForwardBatch:
        batch = build(*args, **kw)
        built.append(batch)
        return batch

    engine.runner.batch_from = spy  # type: ignore[method-assign]
    lengths = [[7], [5, 4], [3, 8, 6], [9, 2, 5, 7, 3, 1]]
    for g, group in enumerate(lengths):
        for i, n in enumerate(group):
            engine.submit(make_request(f"r{g}-{i}", [10 + g + j for j in range(n)], max_new=2))
        while engine.has_work():
            engine.step()
    extends = [b for b in built if b.mode is ForwardMode.EXTEND]
    assert {len(b.extend_lens_cpu) for b in extends} >= {1, 2, 3, 6}
    assert any(sum(b.extend_lens_cpu) % 2 for b in extends)  # an odd token count was met
    for b in built:
        misaligned = [name for name, t in _int_tensors(b).items() if not aligned(t)]
        assert not misaligned, (b.extend_lens_cpu, misaligned)


@pytest.mark.parametrize("bs", [1, 2, 3, 5, 6])
def test_extend_attention_tables_are_aligned(bs: int) -> None:
    """The extend kernel's [bs] tables: rows of one [3, bs] tensor were aligned only when
    bs % 4 == 0."""
    gen = torch.Generator().manual_seed(bs)
    batch, _ = make_batch(ForwardMode.EXTEND, [0] * bs, [3] * bs, 2, 16, gen)
    backend = TritonBackend()
    backend.init_forward_metadata(batch)
    meta = backend._meta
    assert meta is not None and meta.extend is not None
    tables = [meta.extend.prefix_lens, meta.extend.extend_lens, meta.extend.extend_starts]
    assert [t.tolist() for t in tables] == [[0] * bs, [3] * bs, list(range(0, 3 * bs, 3))]
    assert all(aligned(t) for t in tables)
