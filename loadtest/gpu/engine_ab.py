"""The public `radixserve.Engine` against the executor's engine stepped directly, on one engine.

Both paths run the same prompts (loadtest/offline_prompts.py) on the same step engine, so the
same GPU memory, KV pool and CUDA graphs, alternating internal / public / internal / public in
one process: what the public path adds (validation, tokenizer and detokenizer cores, the
stepping thread, results) is all the two differ by. For each run: output tok/s, the steps taken
(extend and decode, and the mean decode batch), and the host's milliseconds per step by phase
(loadtest/gpu/hosttime.py), so a difference shows where it comes from.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from loadtest import offline
from loadtest.gpu.hosttime import HostTimes
from loadtest.gpu.models import llama8b_dir
from loadtest.offline_public import make_public_engine, run_throughput_public
from radixserve import Engine
from radixserve.engine.pipeline import Pipeline
from services.executor.engine.loop import Engine as StepEngine
from services.executor.engine.outputs import StepResult


class StepTally:
    """Counts the step engine's extend and decode steps (wrapping its `step` on the instance)."""

    def __init__(self, engine: StepEngine) -> None:
        self.extend = self.decode = self.decode_tokens = self.extend_tokens = 0
        inner = engine.step

        def counted() -> StepResult:
            result = inner()
            if result.is_decode:
                self.decode += 1
                self.decode_tokens += result.forward_tokens
            elif result.forward_tokens:
                self.extend += 1
                self.extend_tokens += result.forward_tokens
            return result

        engine.step = counted  # type: ignore[method-assign]

    def take(self) -> dict[str, Any]:
        out = {
            "extend_steps": self.extend,
            "decode_steps": self.decode,
            "extend_tokens": self.extend_tokens,
            "decode_batch_mean": round(self.decode_tokens / max(1, self.decode), 2),
        }
        self.extend = self.decode = self.decode_tokens = self.extend_tokens = 0
        return out


def _internal(step: StepEngine, a: argparse.Namespace) -> dict[str, Any]:
    r = offline.run_throughput(step, a)
    keep = ("requests", "finished", "input_tokens", "output_tokens", "elapsed_s", "output_tok_s")
    return {k: r[k] for k in keep} | {"ttft_ms_median": r["ttft_ms_median"]}


def engine_ab_section(
    num_prompts: int = 300, input_len: int = 1024, output_len: int = 512
) -> dict[str, Any]:
    """The GPU run: Llama-3.1-8B shapes with dummy weights and a word tokenizer."""
    model = llama8b_dir(Path(tempfile.mkdtemp()), "words")
    a = offline.parse_args(
        [
            "throughput",
            "--model",
            str(model),
            "--load-format",
            "dummy",
            "--num-prompts",
            str(num_prompts),
            "--input-len",
            str(input_len),
            "--output-len",
            str(output_len),
            "--range-ratio",
            "0.0",
        ]
    )
    return engine_ab(a)


def engine_ab(a: argparse.Namespace, rounds: int = 2) -> dict[str, Any]:
    """`rounds` of (internal, public) on one Engine built from the offline flags `a`."""
    public: Engine = make_public_engine(a)
    step = public.pipeline.engine
    host = HostTimes(step)
    tally = StepTally(step)
    runs: list[dict[str, Any]] = []
    try:
        for _ in range(rounds):
            # The pipeline's thread would step the engine too: stop it for the internal run,
            # then give the Engine a fresh pipeline over the same step engine.
            old = public.pipeline
            old.close()
            step.flush_cache()  # every run prefills its prompts: none starts from the last's cache
            host.start()
            tally.take()
            runs.append({"through": "internal", **_internal(step, a)})
            runs[-1].update(tally.take(), host_ms_per_step=host.per_step())
            public.pipeline = Pipeline(public.tokenization, step, old.grammar_tok)
            public.pipeline.compiled = old.compiled  # the dict the engine's grammars read
            host._wrap(public.pipeline.detok, "handle", "detokenize")
            step.flush_cache()
            host.start()
            runs.append({"through": "engine", **run_throughput_public(public, a)})
            runs[-1].update(tally.take(), host_ms_per_step=host.per_step())
    finally:
        public.shutdown()
    internal = [r["output_tok_s"] for r in runs if r["through"] == "internal"]
    engine = [r["output_tok_s"] for r in runs if r["through"] == "engine"]
    return {
        "workload": f"{a.num_prompts} prompts, input U[1, {a.input_len}], "
        f"output U[1, {a.output_len}]",
        "runs": runs,
        "engine_over_internal": round(sum(engine) / sum(internal), 4),
    }
