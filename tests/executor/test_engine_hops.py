"""The executor's HopTimes: a request's first TokenDelta carries the trace's stamps plus when
it entered the engine, when the step sampling its first token was launched and when that
token reached the host; later deltas carry none. The sender stamps each StepOutput."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.executor.engine.outputs import stamp_published
from shared.messages.common import ErrorInfo, HopTimes
from shared.messages.detok import RequestFailed, StepOutput, TokenDelta
from tests.executor.helpers import write_tiny_model
from tests.executor.test_engine import make_engine, make_request

TRACE_HOPS = HopTimes(gateway_received=1.0, tokenized=2.0, routed=3.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hops"), "llama", seed=5)


def run(model_dir: Path, overlap: bool) -> dict[str, list[TokenDelta]]:
    engine = make_engine(model_dir, overlap=overlap)
    timed = make_request("timed", [5, 6, 7, 8, 9], max_new=4, ignore_eos=True)
    engine.submit(
        msgspec.structs.replace(timed, trace=msgspec.structs.replace(timed.trace, hops=TRACE_HOPS))
    )
    engine.submit(make_request("untimed", [9, 8, 7], max_new=3, ignore_eos=True))
    deltas: dict[str, list[TokenDelta]] = {"timed": [], "untimed": []}
    while engine.has_work():
        for _, out in engine.step().outputs:
            assert isinstance(out, StepOutput)
            for d in out.deltas:
                deltas[d.rid].append(d)
    return deltas


@pytest.mark.parametrize("overlap", [False, True])
def test_first_delta_carries_the_executors_stamps(model_dir: Path, overlap: bool) -> None:
    deltas = run(model_dir, overlap)
    first, *rest = deltas["timed"]
    assert first.token_ids and first.hops is not None
    h = first.hops
    assert (h.gateway_received, h.tokenized, h.routed) == (1.0, 2.0, 3.0)
    assert 3.0 < h.executor_inbox <= h.first_launched <= h.first_on_host
    assert (h.executor_published, h.detok_published) == (0.0, 0.0)  # not the engine's to set
    assert rest and all(d.hops is None for d in rest)
    # a request sent without HopTimes (an older gateway) is not timed
    assert all(d.hops is None for d in deltas["untimed"])


def test_the_sender_stamps_only_steps_that_carry_a_first_token() -> None:
    first = TokenDelta(rid="a", token_ids=[1], hops=TRACE_HOPS)
    step = StepOutput(executor="e", step=3, deltas=[TokenDelta(rid="c", token_ids=[2]), first])
    later = StepOutput(executor="e", step=4, deltas=[TokenDelta(rid="a", token_ids=[1])])
    failed = RequestFailed(rid="b", error=ErrorInfo(status=400, message="x"))
    out = stamp_published([("d0", step), ("d0", later), ("d1", failed)], 42.0)
    assert out == [
        ("d0", msgspec.structs.replace(step, published=42.0)),
        ("d0", later),
        ("d1", failed),
    ]
