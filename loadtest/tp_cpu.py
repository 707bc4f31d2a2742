"""`radixserve-loadtest tp`: tensor parallelism on the CPU (gloo), the same greedy workload on
one rank and on `--tp-size` ranks through `radixserve.Engine`: whether the tokens are the same,
the time each takes, and how much of rank 0's step time goes to the group's collectives (the
row-parallel all-reduces, the embedding's all-reduce, the logits' all-gather, the step tables
and sampled tokens), each timed where it is called (gloo's collectives are synchronous).

    radixserve-loadtest tp --tp-size 2 --out results/tp_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve import Engine
from services.executor.distributed.group import TPGroup
from services.executor.distributed.steps import HostChannel


class CollectiveTimes:
    """Seconds spent in each collective of this process (wrapping the classes' methods)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for cls, name in (
            (TPGroup, "all_reduce"),
            (TPGroup, "all_gather_last"),
            (TPGroup, "broadcast"),
            (HostChannel, "send"),
        ):
            self._wrap(cls, name)

    def _wrap(self, cls: type, name: str) -> None:
        inner: Callable[..., Any] = getattr(cls, name)
        times = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.seconds[name] += time.perf_counter() - t0
                times.calls[name] += 1

        setattr(cls, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def workload(a: argparse.Namespace) -> list[tuple[list[int], dict[str, Any]]]:
    prompts = [[10 + (i * 7 + j) % 200 for j in range(a.input_len)] for i in range(a.num_prompts)]
    params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    return [(p, params) for p in prompts]


def run(engine: Engine, work: list[tuple[list[int], dict[str, Any]]]) -> tuple[list[Any], float]:
    engine.generate(input_ids=[11] * 8, sampling_params={"max_new_tokens": 2})  # warm-up
    engine.flush_cache()
    t0 = time.perf_counter()
    out = engine.generate(input_ids=[p for p, _ in work], sampling_params=work[0][1])
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="radixserve-loadtest tp", description=__doc__)
    p.add_argument("--model", default="", help="default: a tiny random Llama (tests' own)")
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", default="results/tp_cpu.json")
    a = p.parse_args(argv)
    model = a.model
    if not model:
        from tests.executor.helpers import write_tiny_model

        model = str(write_tiny_model(Path(tempfile.mkdtemp()), "llama", seed=11))
    work = workload(a)
    flags: dict[str, Any] = {"device": "cpu", "max_total_tokens": 16384, "show_progress": False}
    with Engine(model, **flags) as one:
        want, one_s = run(one, work)
    times = CollectiveTimes()
    with Engine(model, tp_size=a.tp_size, **flags) as split:
        step = split.pipeline.engine.step
        step_s = [0.0]

        def timed_step() -> Any:
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                step_s[0] += time.perf_counter() - t0

        split.pipeline.engine.step = timed_step  # type: ignore[method-assign]
        run(split, [(work[0][0], work[0][1])])  # the first steps compile nothing, but warm up
        times.reset()
        step_s[0] = 0.0
        got, split_s = run(split, work)
    collective_s = sum(times.seconds.values())
    report = {
        "model": model,
        "tp_size": a.tp_size,
        "prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "same_tokens": [r["output_ids"] for r in got] == [r["output_ids"] for r in want],
        "one_rank_s": round(one_s, 3),
        "tp_s": round(split_s, 3),
        "rank0_step_s": round(step_s[0], 3),
        "collective_s": {k: round(v, 4) for k, v in times.seconds.items()},
        "collective_calls": dict(times.calls),
        "collective_share_of_step": round(collective_s / step_s[0], 4) if step_s[0] else None,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report
