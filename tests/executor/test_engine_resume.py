"""A request resumed on another executor after its own was lost: the engine prefills prompt
plus the output its client already has, sends only what follows, and the whole output is the
one an uninterrupted run gives (greedy tokens equal transformers', a grammar still holds)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from shared.messages.common import HopTimes, JsonSchemaConstraint
from shared.messages.detok import StepOutput
from tests.executor.helpers import hf_greedy, make_hf_model, write_tiny_model
from tests.executor.test_engine import Run, make_engine, make_request, prompts
from tests.executor.test_engine_grammar import Setup

SEED = 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("resume"), "llama", seed=SEED)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model("llama", seed=SEED)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resumed_request_continues_the_greedy_output_and_sends_only_the_rest(
    tiny_dir: Path, hf_model: torch.nn.Module, overlap: bool
) -> None:
    ps = prompts(4, seed=5)
    full = [hf_greedy(hf_model, p, 24) for p in ps]
    cuts = [1, 5, 11, 23]
    reqs = [
        msgspec.structs.replace(
            make_request(f"r{i}", p, logprob_start_len=0),
            resume_ids=full[i][: cuts[i]],
            resumes=1,
            avoid=["lost"],
        )
        for i, p in enumerate(ps)
        if len(full[i]) > cuts[i]
    ]
    assert len(reqs) >= 2
    run = Run(make_engine(tiny_dir, overlap=overlap))
    run.go({0: reqs})
    for req in reqs:
        i = int(req.trace.rid[1:])
        assert run.tokens[req.trace.rid] == full[i][cuts[i] :]  # nothing sent twice
        assert run.finish[req.trace.rid] in ("stop", "length")


def test_a_resumed_request_sends_no_second_first_delta(tiny_dir: Path) -> None:
    """Prompt logprobs and first-token timings went out from the lost executor; the resumed
    request's output logprobs are numbered from where it resumes."""
    hops = HopTimes(gateway_received=1.0)
    req = make_request("a", [3, 4, 5, 6], max_new=8, logprob_start_len=0, return_logprob=True)
    req = msgspec.structs.replace(
        req, trace=msgspec.structs.replace(req.trace, hops=hops), resume_ids=[7, 8, 9], resumes=1
    )
    engine = make_engine(tiny_dir)
    engine.submit(req)
    deltas = []
    while engine.has_work():
        for _, out in engine.step().outputs:
            assert isinstance(out, StepOutput)
            deltas += out.deltas
    assert sum(len(d.token_ids) for d in deltas) == 5  # 8 - the 3 resumed
    assert all(d.prompt_logprobs is None and d.hops is None for d in deltas)
    first = next(d for d in deltas if d.token_ids)
    assert first.logprobs is not None and first.logprobs.start == 3


def test_a_request_resumed_with_its_whole_output_only_ends(tiny_dir: Path) -> None:
    req = msgspec.structs.replace(make_request("done", [3, 4], max_new=3), resume_ids=[5, 6, 7])
    run = Run(make_engine(tiny_dir))
    run.go({0: [req]})
    assert run.tokens["done"] == [] and run.finish["done"] == "length"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_a_resumed_constrained_request_still_follows_its_grammar(tiny_dir: Path, cut: int) -> None:
    setup = Setup(tiny_dir)
    c = JsonSchemaConstraint(schema=json.dumps(SCHEMA))
    first = Run(setup.engine(tiny_dir))
    first.go({0: [setup.request("x", c, 48, temperature=0.0)]})
    whole = first.tokens["x"]
    assert json.loads(setup.text(whole)).keys() == {"name", "ok"}
    resumed = msgspec.structs.replace(
        setup.request("x", c, 48, temperature=0.0), resume_ids=whole[:cut], resumes=1
    )
    second = Run(setup.engine(tiny_dir))
    second.go({0: [resumed]})
    assert whole[:cut] + second.tokens["x"] == whole
    assert second.finish["x"] == first.finish["x"]
