"""Extend steps run as decode rows (services/executor/extend_rows.py): which steps qualify, and
on the tiny model (eager on the CPU, forced on with `rows_max`) the same greedy tokens as
transformers and the same logits as the extend kernels, with cached prefixes, chunked prefill
and several requests a step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor import extend_rows
from services.executor.distributed.steps import StepTables
from services.executor.engine.loop import Engine
from services.executor.engine.records import Forward
from services.executor.forward_batch import ForwardBatch
from services.executor.warmup import warm_up
from tests.executor.helpers import hf_greedy, make_hf_model, write_tiny_model
from tests.executor.test_engine import Run, make_engine, make_request

SEED = 5


def tables(prefixes: list[int], news: list[int], extra: list[int] | None = None) -> StepTables:
    t = StepTables(is_decode=False, sampling_rows=0)
    for row, (p, n) in enumerate(zip(prefixes, news, strict=True)):
        t.ids += [7] * n
        t.positions += range(p, p + n)
        t.slots += range(100 * row + p, 100 * row + p + n)
        t.rows.append(row + 1)
        t.seq_lens.append(p + n)
        t.prefix_lens.append(p)
        t.extend_lens.append(n)
    t.extra = extra or []
    return t


def test_rows_are_one_a_token_with_its_own_length() -> None:
    t = tables([5, 0], [3, 2])
    assert extend_rows.as_rows(t) == ([1, 1, 1, 2, 2], [6, 7, 8, 1, 2])
    # the extra keys: request 0's rows read 6 + 7 + 8 against one row's 8, request 1's 1 + 2
    keys = sum(map(extend_rows.re_read, t.prefix_lens, t.extend_lens))
    assert keys == (6 + 7 + 8 - 8) + (1 + 2 - 2)
    assert extend_rows.re_read(5, 3) == 6 + 7 + 8 - 8 and extend_rows.re_read(9, 1) == 0


def test_which_steps_qualify() -> None:
    assert extend_rows.fits(tables([4000], [1]), max_rows=8)  # a cached prompt's last token
    assert extend_rows.fits(tables([10, 20, 30], [1, 2, 1]), max_rows=8)
    assert not extend_rows.fits(tables([10], [9]), max_rows=8)  # more tokens than rows
    assert not extend_rows.fits(tables([10], [2], extra=[0]), max_rows=8)  # prompt logprobs
    assert not extend_rows.fits(tables([0], [1]), max_rows=0)  # no graphs
    decode = tables([10], [1])
    decode.is_decode = True
    assert not extend_rows.fits(decode, max_rows=8)
    # a long prefix re-read by many rows: past EXTRA_KEYS
    p = extend_rows.EXTRA_KEYS // 31
    assert extend_rows.fits(tables([p - 100], [32]), max_rows=64)
    assert not extend_rows.fits(tables([p + 100], [32]), max_rows=64)


def test_tables_carry_the_choice_to_other_ranks() -> None:
    t = tables([3], [2])
    t.as_rows = True
    header, payload = t.encode()
    got = StepTables.decode(header.tolist(), payload.tolist())
    assert got.as_rows and got.positions == t.positions and got.rows == t.rows


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("rows"), "llama", seed=SEED)


class Recorded:
    """An engine whose runner records each step's batch and the logits it returned."""

    def __init__(self, engine: Engine, rows_max: int | None) -> None:
        self.run = Run(engine)
        runner = self.run.engine.runner
        runner.rows_max = rows_max
        self.batches: list[ForwardBatch] = []
        self.logits: list[torch.Tensor] = []
        build, forward = runner.batch_from, runner.forward

        def batch_from(*a: Any, **k: Any) -> ForwardBatch:
            b = build(*a, **k)
            self.batches.append(b)
            return b

        def fwd(*a: Any, **k: Any) -> Forward:
            f = forward(*a, **k)
            self.logits.append(f.logits.clone())
            return f

        runner.batch_from = batch_from  # type: ignore[method-assign]
        runner.forward = fwd  # type: ignore[method-assign]

    def as_rows(self) -> list[ForwardBatch]:
        return [b for b in self.batches if b.sample_rows is not None]


def _arrivals(ps: list[list[int]], **sp: Any) -> dict[int, list[Any]]:
    # the first prompts, then each again (its whole prompt cached but the last token), then
    # one extended by a few tokens (its prefix cached), and a short new prompt
    first = [make_request(f"a{i}", p, 6) for i, p in enumerate(ps)]
    again = [make_request(f"b{i}", p, 6, **sp) for i, p in enumerate(ps)]
    longer = [make_request(f"c{i}", p + [3, 1, 4][: i + 1], 6) for i, p in enumerate(ps)]
    return {0: first, 12: again, 24: longer, 25: [make_request("d", [9, 8, 7], 6)]}


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_and_logits_as_the_extend_kernels_give(tiny_dir: Path, overlap: bool) -> None:
    ps = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    # the longest prompt takes two chunks of at most 8 tokens
    base = Recorded(make_engine(tiny_dir, overlap=overlap, max_prefill_tokens=8), 0)
    rows = Recorded(make_engine(tiny_dir, overlap=overlap, max_prefill_tokens=8), 64)
    base.run.go(_arrivals(ps))
    rows.run.go(_arrivals(ps))
    assert not base.as_rows()
    taken = rows.as_rows()

    # cached prompts (one token), chunks of a prompt, several requests and tokens in a step
    def shape(b: ForwardBatch) -> tuple[int, int, int]:  # rows, requests, longest prefix
        assert b.sample_rows is not None
        return len(b.extend_lens_cpu), len(b.sample_rows), max(b.prefix_lens_cpu) - 1

    # cached prompts (a token each after a prefix), several tokens of several requests,
    # and the last chunk of a prompt after its first (their tokens cached)
    assert any(rows == reqs > 1 and prefix > 0 for rows, reqs, prefix in map(shape, taken))
    assert any(rows > reqs > 1 for rows, reqs, _ in map(shape, taken))
    assert any(reqs == 1 and prefix >= 7 for _, reqs, prefix in map(shape, taken))
    assert rows.run.tokens == base.run.tokens
    hf = make_hf_model("llama", seed=SEED)
    for rid, tokens in rows.run.tokens.items():
        prompt = {"a": ps, "b": ps}.get(rid[0])
        if prompt is not None:
            assert tokens == hf_greedy(hf, prompt[int(rid[1:])], 6), rid
    assert len(rows.logits) == len(base.logits)
    for got, ref in zip(rows.logits, base.logits, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_prompt_logprobs_keep_the_extend(tiny_dir: Path) -> None:
    ps = [[41, 42, 43, 44], [51, 52]]
    rec = Recorded(make_engine(tiny_dir), 64)
    rec.run.go(_arrivals(ps, return_logprob=True, logprob_start_len=0))
    taken = {id(b) for b in rec.as_rows()}
    # the repeated prompts want their prompt's logprobs: their steps stay extends
    lp_steps = [b for b in rec.batches if b.extra_indices is not None]
    assert lp_steps and not any(id(b) in taken for b in lp_steps)
    assert rec.as_rows()  # the other cached prompts took rows


def test_the_warm_up_compiles_the_extend_kernels(tiny_dir: Path) -> None:
    """Start-up's warm-up batches run as extends even where rows would take them: the
    graphs' capture compiled the decode kernels, and longer prompts still take the extend
    kernels, which a warm-up run as rows left to the first such request (984 ms on an H200)."""
    engine = make_engine(tiny_dir)
    rec = Recorded(engine, 64)
    warm_up(engine)
    assert rec.batches and not rec.as_rows()
    assert engine.runner.rows_max == 64


@pytest.mark.parametrize("rows_max", [0, 64])
def test_steps_are_counted_and_timed_by_what_they_ran(tiny_dir: Path, rows_max: int) -> None:
    """An extend run as decode rows is its own phase in the step results, the engine's totals
    and the exported metrics (radixserve:executor_forward_tokens_total{phase="extend_rows"}):
    its host time is a decode step's, and mixing it into the extends' histogram would hide
    what an eager extend costs."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.executor.metrics import executor_metrics
    from shared.metrics.registry import ServiceMetrics

    engine = make_engine(tiny_dir)
    engine.runner.rows_max = rows_max
    m = ServiceMetrics("executor", "m", "i-1")
    timer = executor_metrics(m, engine)
    engine.submit(make_request("a", [5, 6, 7, 8, 9], 3))
    phases = []
    while engine.has_work():
        result = engine.step()
        timer.observe(0.001, result.phase)
        phases.append(result.phase)
    first = "extend_rows" if rows_max else "extend"
    assert phases == [first, "decode", "decode"]
    s = engine.stats
    assert (s.extend_steps, s.rows_steps, s.decode_steps) == ((0, 1, 2) if rows_max else (1, 0, 2))
    want = {"decode": 2, "extend": 0, "extend_rows": 0}
    want[first] = 5
    assert s.tokens_by_phase() == want
    got = {
        (x.name, x.labels.get("phase")): x.value
        for family in text_string_to_metric_families(m.text().decode())
        for x in family.samples
    }
    assert got[("radixserve:executor_forward_tokens_total", first)] == 5
    assert got[("radixserve:executor_step_seconds_count", first)] == 1
    assert got[("radixserve:executor_step_seconds_count", "decode")] == 2
