"""The engine with the radix cache: reuse is exact (same tokens as transformers), reported,
shared between concurrent requests, and gone after a flush."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor.engine.loop import Engine
from shared.messages.detok import TokenDelta
from tests.executor.helpers import hf_argmax_continuation, make_hf_model, write_tiny_model
from tests.executor.test_engine import Run, make_engine, make_request

SEED = 5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cache"), "llama", seed=SEED)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model("llama", seed=SEED)


def argmax_continuation(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    return hf_argmax_continuation(hf, prompt, n)


class CachedRun(Run):
    """Also records the cached_tokens each request reported."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.cached: dict[str, int] = {}

    def on_delta(self, d: TokenDelta) -> None:
        self.cached[d.rid] = d.cached_tokens


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("disable", [False, True])
def test_second_turn_reuses_the_first(
    tiny_dir: Path, hf_model: torch.nn.Module, disable: bool
) -> None:
    engine = make_engine(tiny_dir, disable_radix_cache=disable)
    p1 = prompt(1, 20)
    run = CachedRun(engine)
    run.go({0: [make_request("t1", p1, max_new=10, ignore_eos=True)]})
    out1 = run.tokens["t1"]
    p2 = p1 + out1 + prompt(2, 7)
    run.go({0: [make_request("t2", p2, max_new=10, ignore_eos=True)]})
    # Turn 1's prompt and output are cached, except the last output token: it was sampled,
    # never fed back, so it has no KV.
    assert run.cached["t2"] == (0 if disable else len(p1) + len(out1) - 1)
    assert run.tokens["t2"] == argmax_continuation(hf_model, p2, 10)
    engine.policy.check_integrity()


def test_concurrent_requests_share_one_prefill(tiny_dir: Path, hf_model: torch.nn.Module) -> None:
    engine = make_engine(tiny_dir)
    system = prompt(3, 40)
    reqs = [
        make_request(f"q{i}", system + prompt(10 + i, 5), max_new=6, ignore_eos=True)
        for i in range(8)
    ]
    run = CachedRun(engine)
    run.go({0: reqs})
    # The first computes the shared 40 tokens; the others wait one step and reuse them.
    assert run.cached["q0"] == 0
    assert [run.cached[f"q{i}"] for i in range(1, 8)] == [40] * 7
    for i, r in enumerate(reqs):
        assert run.tokens[f"q{i}"] == argmax_continuation(hf_model, r.input_ids, 6)


def test_page_size_reuses_whole_pages_only(tiny_dir: Path, hf_model: torch.nn.Module) -> None:
    engine = make_engine(tiny_dir, page_size=4)
    p1 = prompt(4, 18)
    run = CachedRun(engine)
    run.go({0: [make_request("a", p1, max_new=3, ignore_eos=True)]})
    p2 = p1[:13] + prompt(5, 6)
    run.go({0: [make_request("b", p2, max_new=5, ignore_eos=True)]})
    assert run.cached["b"] == 12  # 13 shared tokens, cut to whole pages of 4
    assert run.tokens["b"] == argmax_continuation(hf_model, p2, 5)


@pytest.mark.parametrize(("policy", "first"), [("lpm", "hot"), ("fcfs", "cold")])
def test_admission_order(tiny_dir: Path, policy: str, first: str) -> None:
    """lpm admits the request whose prefix is cached first; fcfs keeps arrival order."""
    engine = make_engine(tiny_dir, max_running_requests=1, schedule_policy=policy)
    warm = prompt(6, 30)
    run = CachedRun(engine)
    run.go({0: [make_request("warm", warm, max_new=2, ignore_eos=True)]})
    order: list[str] = []
    original = engine.policy.mem.attach

    def record(req: Any) -> None:
        order.append(req.rid)
        original(req)

    engine.policy.mem.attach = record  # type: ignore[method-assign]
    run.go(
        {
            0: [
                make_request("cold", prompt(7, 30), max_new=2, ignore_eos=True),
                make_request("hot", [*warm, 1, 2], max_new=2, ignore_eos=True),
            ]
        }
    )
    assert order[0] == first and set(order[:2]) == {"hot", "cold"}


def test_flush_refused_while_running_then_empties_the_cache(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    engine.submit(make_request("x", prompt(8, 10), max_new=50, ignore_eos=True))
    engine.step()
    assert engine.flush_cache() is False
    run = CachedRun(engine)
    run.go({})
    cache = engine.policy.mem.cache
    assert cache.total_size() > 0
    assert engine.flush_cache() is True
    assert cache.total_size() == 0
    assert engine.policy.kv.num_free() == engine.policy.kv.num_slots


def test_eviction_makes_room_for_new_prompts(tiny_dir: Path, hf_model: torch.nn.Module) -> None:
    engine = make_engine(tiny_dir, max_total_tokens=64)
    run = CachedRun(engine)
    for i in range(6):  # each leaves ~40 cached tokens behind; the pool holds 64
        p = prompt(20 + i, 30)
        run.go({0: [make_request(f"e{i}", p, max_new=10, ignore_eos=True)]})
        assert run.tokens[f"e{i}"] == argmax_continuation(hf_model, p, 10)
        engine.policy.check_integrity()
    cache = engine.policy.mem.cache
    assert engine.policy.kv.num_free() + cache.total_size() == 64
