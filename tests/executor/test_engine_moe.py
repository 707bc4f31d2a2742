"""The engine on a tiny MoE model (Qwen2-MoE: routed experts plus a gated shared expert):
greedy tokens equal transformers' under chunked prefill, retraction and radix-cache reuse,
as tests/executor/test_engine.py checks for the dense Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.executor.helpers import hf_argmax_continuation, make_hf_model, write_tiny_model
from tests.executor.test_engine import Run, expected, make_engine, make_request, prompts
from tests.executor.test_engine_cache import CachedRun

SEED = 7
ARCH = "qwen2_moe"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("moe-engine"), ARCH, seed=SEED)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model(ARCH, seed=SEED)


@pytest.mark.parametrize(("chunk", "overlap"), [(3, False), (7, True)])
def test_chunked_prefill_gives_the_same_tokens(
    tiny_dir: Path, hf_model: torch.nn.Module, chunk: int, overlap: bool
) -> None:
    ps = prompts(4, seed=2)
    run = Run(make_engine(tiny_dir, overlap=overlap, max_prefill_tokens=chunk))
    run.go({0: [make_request(f"r{i}", p, max_new=10) for i, p in enumerate(ps)]})
    assert [run.tokens[f"r{i}"] for i in range(4)] == expected(hf_model, ps, 10)


def test_retraction_under_memory_pressure_keeps_outputs(
    tiny_dir: Path, hf_model: torch.nn.Module
) -> None:
    ps = prompts(5, seed=4)
    engine = make_engine(tiny_dir, max_total_tokens=70)
    run = Run(engine)
    run.go({0: [make_request(f"r{i}", p, max_new=40, ignore_eos=True) for i, p in enumerate(ps)]})
    assert engine.policy.num_retracted > 0, "the pool was meant to force retractions"
    for i, p in enumerate(ps):
        assert run.tokens[f"r{i}"] == hf_argmax_continuation(hf_model, p, 40)


def test_second_turn_reuses_the_first(tiny_dir: Path, hf_model: torch.nn.Module) -> None:
    engine = make_engine(tiny_dir)
    p1 = prompts(8, seed=9)[-1]  # 30 tokens
    run = CachedRun(engine)
    run.go({0: [make_request("t1", p1, max_new=8, ignore_eos=True)]})
    out1 = run.tokens["t1"]
    p2 = p1 + out1 + [5, 6, 7]
    run.go({0: [make_request("t2", p2, max_new=8, ignore_eos=True)]})
    # all of turn 1 but its last sampled token (never fed back, so it has no KV)
    assert run.cached["t2"] == len(p1) + len(out1) - 1
    assert run.tokens["t2"] == hf_argmax_continuation(hf_model, p2, 8)
    engine.policy.check_integrity()
