"""The sampling pipeline inside the engine, on a tiny random model checked against
transformers: output and prompt logprobs (with chunked prefill, a cached prefix and overlap),
logit bias, min tokens and penalties."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor.engine.loop import Engine
from shared.messages.detok import LogprobBlock, StepOutput, TokenDelta
from tests.executor.helpers import EOS_ID, make_hf_model, write_tiny_model
from tests.executor.test_engine import make_engine, make_request, prompts

SEED = 5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("sampling"), "llama", seed=SEED)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model("llama", seed=SEED)


def drain(engine: Engine, messages: list[Any]) -> dict[str, list[TokenDelta]]:
    for m in messages:
        engine.submit(m)
    deltas: dict[str, list[TokenDelta]] = defaultdict(list)
    for _ in range(2000):
        if not engine.has_work():
            break
        for _, out in engine.step().outputs:
            assert isinstance(out, StepOutput), out
            for d in out.deltas:
                deltas[d.rid].append(d)
    assert not engine.has_work()
    return deltas


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids`: [len, vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def joined(blocks: list[LogprobBlock | None]) -> LogprobBlock:
    got = [b for b in blocks if b is not None]
    return LogprobBlock(
        start=got[0].start,
        token_ids=[t for b in got for t in b.token_ids],
        logprobs=[x for b in got for x in b.logprobs],
        top_ids=[x for b in got for x in b.top_ids],
        top_logprobs=[x for b in got for x in b.top_logprobs],
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_output_logprobs_match_transformers(
    tiny_dir: Path, hf_model: torch.nn.Module, overlap: bool
) -> None:
    ps = prompts(6, seed=7)
    engine = make_engine(tiny_dir, overlap=overlap)
    reqs = [
        make_request(f"r{i}", p, 12, return_logprob=True, top_logprobs=3, ignore_eos=True)
        for i, p in enumerate(ps)
    ]
    # An unconstrained neighbour without logprobs shares the batch.
    out = drain(engine, [*reqs, make_request("plain", ps[0], 12, ignore_eos=True)])
    assert all(d.logprobs is None for d in out["plain"])
    for i, p in enumerate(ps):
        tokens = [t for d in out[f"r{i}"] for t in d.token_ids]
        lp = joined([d.logprobs for d in out[f"r{i}"]])
        assert lp.token_ids == tokens and len(tokens) == 12
        ref = hf_logprobs(hf_model, p + tokens)[len(p) - 1 : -1]
        want = ref.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(lp.logprobs), want, atol=1e-4, rtol=0)
        top_v, top_i = ref.topk(3, dim=-1)
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), top_v, atol=1e-4, rtol=0)
        assert lp.top_ids == top_i.tolist()
        assert lp.top_ids[0][0] == tokens[0]  # greedy picks the top token


@pytest.mark.parametrize(("start", "chunk"), [(0, 8192), (3, 8192), (0, 7), (5, 4)])
def test_prompt_logprobs_match_transformers(
    tiny_dir: Path, hf_model: torch.nn.Module, start: int, chunk: int
) -> None:
    prompt = prompts(8, seed=9)[7]  # 30 tokens
    engine = make_engine(tiny_dir, max_prefill_tokens=chunk)
    # The same prompt, computed and cached first: the cache may not hide positions whose
    # logits the prompt logprobs need.
    drain(engine, [make_request("warm", prompt, 2)])
    req = make_request("r", prompt, 3, return_logprob=True, top_logprobs=2, logprob_start_len=start)
    out = drain(engine, [req])["r"]
    blocks = [d.prompt_logprobs for d in out if d.prompt_logprobs is not None]
    assert len(blocks) == 1 and out[0].prompt_logprobs is not None
    b = blocks[0]
    assert (b.start, b.token_ids) == (start, prompt[start:])
    assert out[0].cached_tokens <= max(start - 1, 0)
    ref = hf_logprobs(hf_model, prompt)
    first = max(start, 1)
    want = [ref[p - 1, prompt[p]].item() for p in range(first, len(prompt))]
    got = b.logprobs[first - start :]
    if start == 0:
        assert b.logprobs[0] is None and b.top_ids[0] == []
    assert all(x is not None for x in got)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    want_top = ref[first - 1 : len(prompt) - 1].topk(2, dim=-1).indices.tolist()
    assert b.top_ids[first - start :] == want_top


def test_logit_bias_steers_every_token(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    out = drain(engine, [make_request("r", prompts(2)[1], 6, logit_bias={77: 100.0})])
    assert [t for d in out["r"] for t in d.token_ids] == [77] * 6


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_holds_back_eos(tiny_dir: Path, overlap: bool) -> None:
    engine = make_engine(tiny_dir, overlap=overlap)
    # EOS is by far the likeliest token; min tokens must still keep it out for 5 tokens.
    out = drain(
        engine,
        [make_request("r", prompts(2)[1], 20, logit_bias={EOS_ID: 50.0}, min_new_tokens=5)],
    )
    tokens = [t for d in out["r"] for t in d.token_ids]
    assert EOS_ID not in tokens[:5] and tokens[5:] == [EOS_ID]
    assert out["r"][-1].finish == "stop" and out["r"][-1].matched_stop_token == EOS_ID


def penalised_greedy(
    model: torch.nn.Module, prompt: list[int], n: int, rep: float, freq: float, pres: float
) -> list[int]:
    """Greedy decoding with vLLM's penalties, spelled out token by token."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        for t in set(prompt + out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_follow_the_reference(
    tiny_dir: Path, hf_model: torch.nn.Module, overlap: bool
) -> None:
    ps = prompts(4, seed=11)
    engine = make_engine(tiny_dir, overlap=overlap)
    params = dict(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
    msgs = [make_request(f"r{i}", p, 10, ignore_eos=True, **params) for i, p in enumerate(ps)]
    out = drain(engine, [*msgs, make_request("plain", ps[0], 10, ignore_eos=True)])
    for i, p in enumerate(ps):
        got = [t for d in out[f"r{i}"] for t in d.token_ids]
        assert got == penalised_greedy(hf_model, p, 10, 1.8, 0.7, 0.4)
    plain = [t for d in out["plain"] for t in d.token_ids]
    assert plain != [t for d in out["r0"] for t in d.token_ids]  # the penalties did something


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefill_only_request_computes_its_prompt_and_samples_nothing(
    tiny_dir: Path, hf_model: torch.nn.Module, overlap: bool
) -> None:
    """max_new_tokens 0 (SGLang's): the prompt is computed in chunks, its logprobs taken and
    its KV cached; the request ends "length" with no token."""
    prompt = prompts(8, seed=9)[7]  # 30 tokens
    engine = make_engine(tiny_dir, overlap=overlap, max_prefill_tokens=7)
    req = make_request("p", prompt, 0, return_logprob=True, logprob_start_len=0)
    out = drain(engine, [req])["p"]
    assert [t for d in out for t in d.token_ids] == []
    assert out[-1].finish == "length"
    (block,) = [d.prompt_logprobs for d in out if d.prompt_logprobs is not None]
    ref = hf_logprobs(hf_model, prompt)
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    torch.testing.assert_close(
        torch.tensor(block.logprobs[1:]), torch.tensor(want), atol=1e-4, rtol=0
    )
    # Its prompt stayed in the cache: the next request on it computes only the last token.
    (first, *_) = drain(engine, [make_request("next", prompt, 2)])["next"]
    assert first.cached_tokens == len(prompt) - 1
    kv, cache = engine.policy.kv, engine.policy.mem.cache
    assert kv.num_free() + cache.total_size() == kv.num_slots


def test_logprobs_may_start_at_the_prompts_end(tiny_dir: Path) -> None:
    """logprob_start_len equal to the prompt's length (SGLang allows it): no prompt token's."""
    prompt = prompts(8, seed=9)[3]
    req = make_request("e", prompt, 0, return_logprob=True, logprob_start_len=len(prompt))
    out = drain(make_engine(tiny_dir), [req])["e"]
    blocks = [d.prompt_logprobs for d in out if d.prompt_logprobs is not None]
    assert out[-1].finish == "length" and all(b.token_ids == [] for b in blocks)


def test_prefill_only_requests_in_flight_are_never_recomputed_or_evicted(tiny_dir: Path) -> None:
    """With overlap, a prefill-only request whose last chunk is in flight has nothing left to
    compute and samples no token. Planning the next step must pass over it: taking it for out
    of memory evicted it (freeing slots the device was still writing) and prefilled it again;
    with many of them the planner recursed until Python gave up (SGLang's `select` sends many)."""
    engine = make_engine(tiny_dir, overlap=True, max_prefill_tokens=64)
    ps = prompts(8, seed=21)
    reqs = [
        make_request(f"p{i}", p, 0, return_logprob=True, logprob_start_len=0)
        for i, p in enumerate(ps)
    ]
    reqs += [make_request(f"g{i}", p, 3, ignore_eos=True) for i, p in enumerate(ps[:3])]
    computed = 0
    original = engine.runner.forward

    def forward(plan: Any, prev: Any = None) -> Any:
        nonlocal computed
        computed += sum(
            n for r, n in zip(plan.reqs, plan.extend_lens, strict=True) if r.rid[0] == "p"
        )
        return original(plan, prev=prev)

    engine.runner.forward = forward  # type: ignore[method-assign]
    out = drain(engine, reqs)
    for i, p in enumerate(ps):
        deltas = out[f"p{i}"]
        assert deltas[-1].finish == "length" and not [t for d in deltas for t in d.token_ids]
        blocks = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
        assert len(blocks) == 1 and len(blocks[0].token_ids) == len(p)
    assert computed == sum(len(p) for p in ps)  # every prompt computed once
    engine.policy.check_integrity()
