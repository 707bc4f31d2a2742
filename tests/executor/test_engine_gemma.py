"""Gemma 2 and Gemma 3 in the engine: with sliding windows of 8 tokens (shorter than most
prompts here), chunked prefill, prefix reuse from the radix cache and retraction all give
transformers' own tokens. The KV pool keeps every token; the window is only a mask, so a
cached prefix is exact whatever its length."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.executor.helpers import (
    hf_argmax_continuation,
    hf_greedy,
    make_hf_model,
    write_tiny_model,
)
from tests.executor.test_engine import Run, make_engine, make_request, prompts
from tests.executor.test_engine_cache import CachedRun, prompt

SEED = 6


class Tiny(NamedTuple):
    path: Path
    hf: torch.nn.Module


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    arch = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=SEED)
    return Tiny(path, make_hf_model(arch, seed=SEED))


def test_chunked_prefill_across_the_window(tiny: Tiny) -> None:
    """Chunks of 5 tokens: a chunk's queries see the window partly in the cached prefix."""
    ps = prompts(6, seed=7)
    run = Run(make_engine(tiny.path, max_prefill_tokens=5))
    run.go({0: [make_request(f"r{i}", p, max_new=12) for i, p in enumerate(ps)]})
    assert [run.tokens[f"r{i}"] for i in range(6)] == [hf_greedy(tiny.hf, p, 12) for p in ps]


def test_retraction_keeps_outputs(tiny: Tiny) -> None:
    ps = prompts(5, seed=8)
    engine = make_engine(tiny.path, max_total_tokens=80)
    run = Run(engine)
    run.go({0: [make_request(f"r{i}", p, max_new=40, ignore_eos=True) for i, p in enumerate(ps)]})
    assert engine.policy.num_retracted > 0, "the pool was meant to force retractions"
    for i, p in enumerate(ps):
        assert run.tokens[f"r{i}"] == hf_argmax_continuation(tiny.hf, p, 40)


def test_second_turn_reuses_the_first(tiny: Tiny) -> None:
    """The whole first turn (far longer than the window) is reused from the radix cache."""
    engine = make_engine(tiny.path)
    p1 = prompt(1, 20)
    run = CachedRun(engine)
    run.go({0: [make_request("t1", p1, max_new=10, ignore_eos=True)]})
    p2 = p1 + run.tokens["t1"] + prompt(2, 7)
    run.go({0: [make_request("t2", p2, max_new=10, ignore_eos=True)]})
    assert run.cached["t2"] == len(p1) + 10 - 1
    assert run.tokens["t2"] == hf_argmax_continuation(tiny.hf, p2, 10)
    engine.policy.check_integrity()
