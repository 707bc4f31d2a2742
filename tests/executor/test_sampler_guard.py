"""The sampler never hands torch.multinomial a row without a distribution: non-finite
logits, tiny or NaN temperatures, a top_p that underflows float32, min_p above 1 and top_k
beyond the vocabulary each give a token, and a hostile row leaves its neighbours' draws alone."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from services.executor.sampling.sampler import SamplingTensors, finite_argmax, sample
from shared.messages.common import SamplingParams
from shared.messages.schedule import TokenizedRequest
from tests.executor.helpers import write_tiny_model
from tests.executor.test_engine import Run, make_engine, make_request, prompts

VOCAB = 16
NAN, INF = float("nan"), float("inf")
CPU = torch.device("cpu")


def logits_rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def a_row(peak: int) -> list[float]:
    row = [0.0] * VOCAB
    row[peak] = 5.0
    return row


def test_finite_argmax_skips_nan_and_inf_and_falls_back_to_token_zero() -> None:
    nan_row = a_row(3)
    nan_row[9] = NAN
    inf_row = a_row(4)
    inf_row[1] = INF
    none = [-INF] * VOCAB
    all_nan = [NAN] * VOCAB
    got = finite_argmax(logits_rows(nan_row, inf_row, none, all_nan))
    assert got.tolist() == [3, 4, 0, 0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=1e-165),  # 0 in float32
        SamplingParams(temperature=1.0, top_p=1e-45),
        SamplingParams(temperature=1e-40),  # a float32 denormal: logits / t overflow
        SamplingParams(temperature=1e-300),  # 0 in float32: greedy
        SamplingParams(temperature=1e38),
        SamplingParams(temperature=INF),
        SamplingParams(temperature=NAN),
        SamplingParams(temperature=-1.0),
        SamplingParams(temperature=1.0, min_p=5.0),
        SamplingParams(temperature=1.0, min_p=NAN),
        SamplingParams(temperature=1.0, top_k=2**40),
        SamplingParams(temperature=1.0, top_k=-7),
        SamplingParams(temperature=1.0, top_p=NAN),
    ],
    ids=lambda p: f"t={p.temperature},p={p.top_p},k={p.top_k},m={p.min_p}",
)
def test_extreme_parameters_give_a_token_in_the_vocab(params: SamplingParams) -> None:
    logits = logits_rows(a_row(6), a_row(2))
    st = SamplingTensors.build([params, params], VOCAB, logits.device)
    for seed in range(5):
        tokens = sample(logits, st, torch.Generator().manual_seed(seed))
        assert ((tokens >= 0) & (tokens < VOCAB)).all(), tokens


def test_top_p_that_underflows_keeps_the_most_likely_token() -> None:
    logits = logits_rows(a_row(6), a_row(11))
    st = SamplingTensors.build([SamplingParams(temperature=1.0, top_p=1e-165)] * 2, VOCAB, CPU)
    for seed in range(10):
        assert sample(logits, st, torch.Generator().manual_seed(seed)).tolist() == [6, 11]


def test_min_p_above_one_keeps_the_most_likely_token() -> None:
    st = SamplingTensors.build([SamplingParams(temperature=1.0, min_p=3.0)], VOCAB, CPU)
    assert sample(logits_rows(a_row(8)), st, torch.Generator().manual_seed(0)).tolist() == [8]


@pytest.mark.parametrize("poison", [NAN, INF])
def test_a_poisoned_row_takes_its_finite_argmax_and_spares_the_others(poison: float) -> None:
    bad = a_row(5)
    bad[12] = poison
    params = [SamplingParams(temperature=1.0)] * 2
    st = SamplingTensors.build(params, VOCAB, CPU)
    uniform = [0.0] * VOCAB  # the neighbour's draws must still spread over the vocab
    seen: set[int] = set()
    for seed in range(40):
        tokens = sample(logits_rows(bad, uniform), st, torch.Generator().manual_seed(seed))
        assert tokens[0].item() == 5
        seen.add(int(tokens[1].item()))
    assert len(seen) > 4


def test_fully_masked_row_in_a_sampled_batch_gets_token_zero() -> None:
    st = SamplingTensors.build([SamplingParams(temperature=0.7, top_k=3)] * 2, VOCAB, CPU)
    tokens = sample(logits_rows([-INF] * VOCAB, a_row(9)), st, torch.Generator().manual_seed(1))
    assert tokens.tolist() == [0, 9]


def test_a_seeded_poisoned_row_does_not_raise() -> None:
    bad = [NAN] * VOCAB
    st = SamplingTensors.build([SamplingParams(temperature=1.0, seed=3)], VOCAB, CPU)
    gens: list[torch.Generator | None] = [torch.Generator().manual_seed(3)]
    assert sample(logits_rows(bad), st, None, gens).tolist() == [0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("guard"), "llama", seed=3)


def sampled(req: TokenizedRequest, temperature: float) -> TokenizedRequest:
    sp = msgspec.structs.replace(req.sampling, temperature=temperature)
    return msgspec.structs.replace(req, sampling=sp)


def test_engine_completes_a_request_with_top_p_1e_minus_165(tiny_dir: Path) -> None:
    """The issue's crash: the real engine, sampled rows in one batch with a normal request."""
    engine = make_engine(tiny_dir)
    p = prompts(2)
    run = Run(engine)
    hostile = sampled(make_request("hostile", p[0], 8, top_p=1e-165, ignore_eos=True), 1.0)
    normal = sampled(make_request("normal", p[1], 8, ignore_eos=True), 0.8)
    run.go({0: [hostile, normal]})
    assert run.failed == {}
    assert len(run.tokens["hostile"]) == 8 and len(run.tokens["normal"]) == 8
    # top_p ~ 0 keeps only the most likely token: the same tokens as greedy decoding.
    greedy = Run(make_engine(tiny_dir))
    greedy.go({0: [make_request("g", p[0], 8, ignore_eos=True)]})
    assert run.tokens["hostile"] == greedy.tokens["g"]
