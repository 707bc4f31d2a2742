"""The engine on a tiny random model: greedy tokens equal transformers' under continuous
batching, chunked prefill, retraction and aborts, with the KV pool intact after every step."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor.builder import EngineSettings, build_engine
from services.executor.engine.loop import Engine
from services.executor.grammar.backend import GrammarBackend
from shared.messages.common import AbortRequest, SamplingParams, Trace
from shared.messages.detok import RequestFailed, StepOutput, TokenDelta
from shared.messages.schedule import TokenizedRequest
from shared.model_files import resolve_model
from tests.executor.helpers import (
    EOS_ID,
    hf_argmax_continuation,
    hf_greedy,
    make_hf_model,
    write_tiny_model,
)

SEED = 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("engine"), "llama", seed=SEED)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model("llama", seed=SEED)


def make_engine(
    path: Path, overlap: bool = False, grammars: GrammarBackend | None = None, **kw: Any
) -> Engine:
    settings = EngineSettings(
        model=resolve_model(str(path)), name="e0", stream="rs:exec:e0", device="cpu", **kw
    )
    engine = build_engine(settings, grammars=grammars)
    # On the CPU the device is synchronous, but the overlapped schedule (launch step N+1,
    # then record step N's tokens) runs the same bookkeeping as on a GPU.
    engine.overlap = overlap
    return engine


def make_request(rid: str, prompt: list[int], max_new: int = 24, **sp: object) -> TokenizedRequest:
    return TokenizedRequest(
        trace=Trace(rid=rid, reply_to="rs:reply:g", deadline=1e12),
        input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0, **sp),  # type: ignore[arg-type]
        max_new_tokens=max_new,
        eos_token_ids=[EOS_ID],
        detok_stream="rs:detok:0",
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 13, 23, 8, 17, 3, 30][:n]
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lengths]


class Run:
    """Steps an engine to completion, submitting requests at given steps."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, str] = {}
        self.failed: dict[str, RequestFailed] = {}
        self.batch_sizes: list[int] = []
        self.launched: list[tuple[bool, bool]] = []  # (is_decode, overlapped) of each step

    def go(self, arrivals: dict[int, list[Any]], max_steps: int = 2000) -> None:
        step = 0
        while step < max_steps:
            for msg in arrivals.pop(step, []):
                self.engine.submit(msg)
            if not self.engine.has_work() and not arrivals:
                break
            launched, overlapped = self.engine.step_no, self.engine.overlapped_steps
            result = self.engine.step()
            if self.engine.step_no > launched:
                self.launched.append((result.is_decode, self.engine.overlapped_steps > overlapped))
            self.engine.policy.check_integrity()
            self.batch_sizes.append(len(self.engine.policy.running))
            for _, out in result.outputs:
                if isinstance(out, RequestFailed):
                    self.failed[out.rid] = out
                    continue
                assert isinstance(out, StepOutput)
                for d in out.deltas:
                    assert d.rid not in self.finish, f"{d.rid} got tokens after finishing"
                    self.on_delta(d)
                    self.tokens[d.rid] += d.token_ids
                    if d.finish:
                        self.finish[d.rid] = d.finish
            step += 1
        assert not self.engine.has_work(), "engine did not drain"
        kv, cache = self.engine.policy.kv, self.engine.policy.mem.cache
        assert cache.protected_size() == 0, "a finished request still locks the cache"
        assert kv.num_free() + cache.total_size() == kv.num_slots, "KV slots leaked"

    def on_delta(self, d: TokenDelta) -> None:
        """Every delta the engine sent, in order (for subclasses that record more)."""


def expected(hf_model: torch.nn.Module, ps: list[list[int]], max_new: int) -> list[list[int]]:
    return [hf_greedy(hf_model, p, max_new) for p in ps]


@pytest.mark.parametrize("overlap", [False, True])
def test_batched_greedy_matches_transformers(
    tiny_dir: Path, hf_model: torch.nn.Module, overlap: bool
) -> None:
    ps = prompts(8)
    run = Run(make_engine(tiny_dir, overlap=overlap))
    run.go({0: [make_request(f"r{i}", p) for i, p in enumerate(ps)]})
    assert (run.engine.overlapped_steps > 0) == overlap
    assert [run.tokens[f"r{i}"] for i in range(8)] == expected(hf_model, ps, 24)
    for i in range(8):
        tokens = run.tokens[f"r{i}"]
        assert run.finish[f"r{i}"] == ("stop" if tokens[-1] == EOS_ID else "length")
    assert max(run.batch_sizes) > 1


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_join_the_running_batch(
    tiny_dir: Path, hf_model: torch.nn.Module, overlap: bool
) -> None:
    ps = prompts(6, seed=1)
    run = Run(make_engine(tiny_dir, overlap=overlap))
    arrivals: dict[int, list[object]] = {
        3 * i: [make_request(f"r{i}", p)] for i, p in enumerate(ps)
    }
    run.go(arrivals)
    assert [run.tokens[f"r{i}"] for i in range(6)] == expected(hf_model, ps, 24)
    # Later arrivals decoded alongside earlier ones: the running batch grew past one.
    assert max(run.batch_sizes) >= 3


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_prefill_gives_the_same_tokens(
    tiny_dir: Path, hf_model: torch.nn.Module, chunk: int, overlap: bool
) -> None:
    ps = prompts(4, seed=2)
    run = Run(make_engine(tiny_dir, overlap=overlap, max_prefill_tokens=chunk))
    run.go({0: [make_request(f"r{i}", p, max_new=12) for i, p in enumerate(ps)]})
    assert [run.tokens[f"r{i}"] for i in range(4)] == expected(hf_model, ps, 12)


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_under_memory_pressure_keeps_outputs(
    tiny_dir: Path, hf_model: torch.nn.Module, overlap: bool
) -> None:
    ps = prompts(6, seed=4)
    engine = make_engine(tiny_dir, overlap=overlap, max_total_tokens=90)
    run = Run(engine)
    run.go({0: [make_request(f"r{i}", p, max_new=60, ignore_eos=True) for i, p in enumerate(ps)]})
    assert engine.policy.num_retracted > 0, "the pool was meant to force retractions"
    for i in range(len(ps)):
        assert len(run.tokens[f"r{i}"]) == 60
        assert run.finish[f"r{i}"] == "length"
    # ignore_eos: compare with transformers' argmax at every position, EOS included.
    for i, p in enumerate(ps):
        assert run.tokens[f"r{i}"] == hf_argmax_continuation(hf_model, p, 60)


def test_overlap_goes_on_while_requests_wait_and_prefill(
    tiny_dir: Path, hf_model: torch.nn.Module
) -> None:
    """More requests than may run at once, prompts prefilled in chunks: steps are launched
    ahead of the previous step's tokens while others wait or prefill, and every output is
    still transformers' own."""
    ps = prompts(8, seed=5)
    engine = make_engine(tiny_dir, overlap=True, max_running_requests=3, max_prefill_tokens=6)
    overlapped_while_busy = 0
    original = engine.runner.forward

    def forward(plan: Any, prev: Any = None) -> Any:
        nonlocal overlapped_while_busy
        p = engine.policy
        if prev is not None and (p.waiting or p.prefilling or not plan.is_decode):
            overlapped_while_busy += 1
        return original(plan, prev=prev)

    engine.runner.forward = forward  # type: ignore[method-assign]
    run = Run(engine)
    run.go({0: [make_request(f"r{i}", p, max_new=16) for i, p in enumerate(ps)]})
    assert overlapped_while_busy > 0
    assert [run.tokens[f"r{i}"] for i in range(8)] == expected(hf_model, ps, 16)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_the_slots_at_once(tiny_dir: Path, overlap: bool) -> None:
    engine = make_engine(tiny_dir, overlap=overlap)
    run = Run(engine)
    run.go(
        {
            0: [
                make_request("keep", [1, 2, 3], max_new=20, ignore_eos=True),
                make_request("drop", [4, 5, 6, 7], max_new=200, ignore_eos=True),
            ],
            5: [AbortRequest(rid="drop")],
        }
    )
    assert run.finish == {"keep": "length", "drop": "abort"}
    assert 0 < len(run.tokens["drop"]) < 200


def test_request_larger_than_the_pool_fails_clearly(tiny_dir: Path) -> None:
    run = Run(make_engine(tiny_dir, max_total_tokens=32))
    run.go({0: [make_request("big", list(range(30)), max_new=10)]})
    assert run.failed["big"].error.status == 400
    assert "KV slots" in run.failed["big"].error.message


def test_a_request_filling_the_pool_exactly_fits_the_slot_table(tiny_dir: Path) -> None:
    """The slot table is as wide as the pool when the pool is shorter than the model's
    context (no row wider than any request can be): a request of exactly the pool's size
    runs to its end, and one token more is refused."""
    engine = make_engine(tiny_dir, max_total_tokens=32)
    assert engine.runner.req_to_token.max_context == engine.policy.kv.num_slots == 32
    run = Run(engine)
    run.go({0: [make_request("fits", list(range(1, 23)), max_new=10, ignore_eos=True)]})
    assert len(run.tokens["fits"]) == 10
    run = Run(make_engine(tiny_dir, max_total_tokens=32))
    run.go({0: [make_request("over", list(range(1, 23)), max_new=11, ignore_eos=True)]})
    assert run.failed["over"].error.status == 400


def test_sampling_respects_max_tokens_and_vocab(tiny_dir: Path) -> None:
    run = Run(make_engine(tiny_dir))
    reqs = [
        TokenizedRequest(
            trace=Trace(rid=f"s{i}", reply_to="g", deadline=1e12),
            input_ids=[1, 2, 3],
            sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True),
            max_new_tokens=16,
            eos_token_ids=[EOS_ID],
            detok_stream="d",
        )
        for i in range(4)
    ]
    run.go({0: list(reqs)})
    for i in range(4):
        assert len(run.tokens[f"s{i}"]) == 16
        assert all(0 <= t < 264 for t in run.tokens[f"s{i}"])


def test_seeded_request_is_reproducible_in_any_batch(tiny_dir: Path) -> None:
    def seeded(rid: str, seed: int) -> TokenizedRequest:
        return TokenizedRequest(
            trace=Trace(rid=rid, reply_to="g", deadline=1e12),
            input_ids=[7, 8, 9],
            sampling=SamplingParams(temperature=1.5, seed=seed, ignore_eos=True),
            max_new_tokens=20,
            eos_token_ids=[EOS_ID],
            detok_stream="d",
        )

    alone = Run(make_engine(tiny_dir))
    alone.go({0: [seeded("a", 1234)]})
    busy = Run(make_engine(tiny_dir))
    others = [make_request(f"o{i}", p, ignore_eos=True) for i, p in enumerate(prompts(5))]
    unseeded = [
        TokenizedRequest(
            trace=Trace(rid=f"u{i}", reply_to="g", deadline=1e12),
            input_ids=[7, 8, 9],
            sampling=SamplingParams(temperature=1.5, ignore_eos=True),
            max_new_tokens=20,
            eos_token_ids=[EOS_ID],
            detok_stream="d",
        )
        for i in range(3)
    ]
    busy.go({0: [*others[:3], *unseeded], 2: [seeded("a", 1234), seeded("b", 99)], 4: others[3:]})
    assert busy.tokens["a"] == alone.tokens["a"]
    assert len(alone.tokens["a"]) == 20
    assert busy.tokens["b"] != busy.tokens["a"]  # another seed, another stream


def test_token_id_outside_the_model_vocabulary_fails_only_that_request(tiny_dir: Path) -> None:
    """A tokenizer larger than the model's embedding would let such ids through: the request
    gets a 400 naming input_ids, and the batch it would have joined runs on."""
    engine = make_engine(tiny_dir)
    vocab = engine.runner.vocab_size
    run = Run(engine)
    run.go(
        {
            0: [
                make_request("ok", [1, 2, 3], max_new=8, ignore_eos=True),
                make_request("bad", [1, vocab, 3], max_new=8),
            ]
        }
    )
    assert run.finish == {"ok": "length"}
    err = run.failed["bad"].error
    assert err.status == 400 and err.param == "input_ids" and str(vocab) in err.message


def test_a_prompt_finished_in_flight_starts_decoding_not_a_one_token_extend(
    tiny_dir: Path, hf_model: torch.nn.Module
) -> None:
    """With overlap the step after a prompt's last chunk is planned before its first token is
    known; that token must go to a decode step (a graph replay on a GPU), never to an eager
    one-token extend of its own."""
    engine = make_engine(tiny_dir, overlap=True, max_prefill_tokens=8)
    steps: list[tuple[bool, list[int]]] = []
    original = engine.runner.forward

    def forward(plan: Any, prev: Any = None) -> Any:
        steps.append((plan.is_decode, list(plan.extend_lens)))
        return original(plan, prev=prev)

    engine.runner.forward = forward  # type: ignore[method-assign]
    ps = prompts(8, seed=6)[-2:]  # 17 and 30 tokens: several chunks each
    run = Run(engine)
    run.go({0: [make_request(f"r{i}", p, max_new=10) for i, p in enumerate(ps)]})
    assert [run.tokens[f"r{i}"] for i in range(2)] == expected(hf_model, ps, 10)
    extends = [lens for is_decode, lens in steps if not is_decode]
    assert sum(map(sum, extends)) == sum(map(len, ps)), f"extends beyond the prompts: {steps}"


def test_warm_up_runs_its_batches_and_leaves_the_engine_empty(tiny_dir: Path) -> None:
    from services.executor.warmup import WARMUP_BATCHES, warm_up

    engine = make_engine(tiny_dir, overlap=True)
    launched: list[int] = []
    original = engine.runner.forward

    def forward(plan: Any, prev: Any = None) -> Any:
        launched.append(sum(plan.extend_lens))
        return original(plan, prev=prev)

    engine.runner.forward = forward  # type: ignore[method-assign]
    warm_up(engine)
    assert sum(launched) >= sum(map(sum, WARMUP_BATCHES))
    assert not engine.has_work() and not engine.requests()
    kv, cache = engine.policy.kv, engine.policy.mem.cache
    assert cache.total_size() == 0 and kv.num_free() == kv.num_slots
