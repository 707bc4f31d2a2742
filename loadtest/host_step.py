"""`radixserve-loadtest hoststep`: the host's time per decode step at a large batch, on the CPU.

Issue 26 asks for at most 3 ms of host work per decode step at batch 256. The host phases
(plan, launch, sample, finish, collect: loadtest/gpu/hosttime.py, the ones `gpu_bench
--sections scale` reports) are Python work that does not depend on the device, so they are
measured here without one: the real engine (batch policy, radix cache, model runner, sampler,
outputs) steps `--batch` requests of `--input-len` prompt tokens through the overlapped loop,
with a stand-in model whose forward pass only returns logits. What the phases cost then is
the engine's own bookkeeping, which is what the GPU run's host time is made of (plus its
kernel launches, pinned copies and graph replay, which do not grow with the batch).

    radixserve-loadtest hoststep --batch 256 --input-len 512,2048 --output-len 128

Prints, one row per input length, each phase's median milliseconds over the DECODE steps and
its mean over all steps (`finish` includes `wait`; `step` is the whole call), and the host's
work per decode step: the medians of collect, plan, launch, sample and finish less wait.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from loadtest.gpu.hosttime import HostTimes
from loadtest.offline import request
from services.executor.builder import EngineSettings, build_engine
from services.executor.engine.loop import Engine
from services.executor.forward_batch import ForwardBatch
from shared.messages.detok import RequestFailed
from shared.model_files import resolve_model

PHASES = ("collect", "plan", "launch", "sample", "finish", "wait", "step")
HOST = ("collect", "plan", "launch", "sample", "finish")  # the host's work (finish less wait)


class FreeModel:
    """A model whose forward pass costs next to nothing: zero logits, one row per request
    (greedy sampling then takes token 0). The engine's host work is all that is left."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        return torch.zeros(batch.batch_size, self.vocab)


def make_engine(model: str, batch: int, input_len: int, output_len: int) -> Engine:
    settings = EngineSettings(
        model=resolve_model(model),
        name="hoststep",
        stream="hoststep",
        device="cpu",
        max_total_tokens=batch * (input_len + output_len + 8) + 1024,
        max_running_requests=batch,
        max_prefill_tokens=16384,
    )
    engine = build_engine(settings)
    engine.runner.model = FreeModel(engine.runner.vocab_size)
    engine.overlap = True  # the GPU's loop: step N+1 launched before step N's tokens land
    return engine


def measure(engine: Engine, batch: int, input_len: int, output_len: int, seed: int) -> dict:
    """Submit the batch at once and step until it is done: every phase's median over the
    DECODE steps, and its mean over all steps (the figure `gpu_bench --sections scale`
    prints, which spreads the prefill's steps over the run)."""
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    host = HostTimes(engine)
    for i in range(batch):
        ids = [rng.randrange(vocab) for _ in range(input_len)]
        engine.submit(request(f"s{seed}-{i}", ids, output_len))
    full = 0  # decode steps with the whole batch running
    while engine.has_work():
        result = engine.step()
        full += result.is_decode and result.forward_tokens == batch
        failed = [m for _, m in result.outputs if isinstance(m, RequestFailed)]
        if failed:
            raise RuntimeError(f"request failed: {failed[0]}")
    medians = host.medians()
    mean = host.per_step()
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "steps": len(host.history),
        "decode_steps": sum(host.decode),
        "full_batch_decode_steps": full,
        "decode_median_ms": {k: medians.get(k, 0.0) for k in PHASES},
        "all_steps_mean_ms": {k: mean.get(k, 0.0) for k in PHASES},
        "host_ms_per_decode_step": round(
            sum(medians.get(k, 0.0) for k in HOST) - medians.get("wait", 0.0), 3
        ),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="radixserve-loadtest hoststep", description=__doc__)
    p.add_argument("--model", default="", help="default: a tiny random Llama (tests' own)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", default="512,2048", help="comma-separated: one row each")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", default="", help="also write the rows here as JSON")
    a = p.parse_args(argv)
    # The stand-in's few tensor ops on one thread: the CPU's other threads would only spin
    # (and stall on a busy machine), where on a GPU this work is the device's.
    torch.set_num_threads(1)
    model = a.model
    if not model:
        from tests.executor.helpers import write_tiny_model

        # long enough for the longest prompt and its output (the weights are never run)
        positions = max(int(x) for x in a.input_len.split(",")) + a.output_len + 8
        tmp = Path(tempfile.mkdtemp())
        model = str(write_tiny_model(tmp, "llama", seed=11, max_position_embeddings=positions))
    lens = [int(x) for x in a.input_len.split(",")]
    engine = make_engine(model, a.batch, max(lens), a.output_len)
    rows = []
    for seed, n in enumerate(lens, start=1):
        row = measure(engine, a.batch, n, a.output_len, seed)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
