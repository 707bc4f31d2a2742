"""Extend steps as decode rows on the GPU, replayed from the CUDA graphs
(services/executor/extend_rows.py): the same greedy tokens and, within fp32's rounding, the
same logits as the eager extend kernels, on the engine with cached prompts, chunked prefill and
several requests a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.executor.builder import EngineSettings, build_engine
from services.executor.engine.loop import Engine
from services.executor.forward_batch import ForwardBatch
from shared.model_files import resolve_model
from tests.executor.helpers import write_tiny_model
from tests.executor.test_extend_rows import Recorded, _arrivals

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("overlap", [False, True])
def test_rows_replayed_from_graphs_answer_as_the_extend(tmp_path: Path, overlap: bool) -> None:
    path = write_tiny_model(tmp_path, "llama", seed=5)
    ps = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]

    def engine() -> Engine:
        settings = EngineSettings(
            model=resolve_model(str(path)), name="e0", stream="rs:exec:e0", device="cuda",
            dtype="float32", max_prefill_tokens=8, cuda_graph_max_bs=16, max_total_tokens=4096,
        )  # fmt: skip
        e = build_engine(settings)
        e.overlap = overlap
        return e

    base, rows = Recorded(engine(), 0), Recorded(engine(), None)
    assert rows.run.engine.runner.graphs is not None
    graphed: list[bool] = []
    replay = rows.run.engine.runner.graphs.replay

    def spy(batch: ForwardBatch) -> torch.Tensor:
        graphed.append(batch.sample_rows is not None)
        return replay(batch)

    rows.run.engine.runner.graphs.replay = spy  # type: ignore[method-assign]
    base.run.go(_arrivals(ps))
    rows.run.go(_arrivals(ps))
    assert not base.as_rows() and len(rows.as_rows()) >= 4
    assert sum(graphed) == len(rows.as_rows())  # every one replayed from a graph
    assert rows.run.tokens == base.run.tokens
    for got, ref in zip(rows.logits, base.logits, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)
