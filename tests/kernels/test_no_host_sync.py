"""The host must never wait for the device while it prepares a step: a blocking copy in the
sampler stops the CPU work of step N+1 until the forward pass of step N is done. CUDA's sync
debug mode turns every synchronising call into an error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor.sampling.sampler import SamplingTensors, sample
from shared.messages.common import SamplingParams


@pytest.mark.gpu
def test_sampling_a_mixed_batch_never_synchronises() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05),
    ]
    logits = torch.randn(3, 1000, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = SamplingTensors.build(params, 1000, logits.device)
        tokens = sample(logits, st, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (3,)
    assert int(tokens[0]) == int(logits[0].argmax())
    top5 = set(logits[2].topk(5).indices.tolist())
    assert int(tokens[2]) in top5


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_launching_steps_never_synchronises(tmp_path: Path, arch: str) -> None:
    """Planning and launching a step, an eager EXTEND and a graphed DECODE alike, queues its
    work without waiting for the device: a blocking copy in the forward pass held the host
    until every layer ran, so the next step launched only once the device sat idle. The
    tokens' own wait (`Sampled.wait`) is a step's one synchronisation."""
    from loadtest import offline
    from tests.executor.helpers import write_tiny_model

    path = write_tiny_model(tmp_path, arch, seed=1, max_position_embeddings=1024)
    args = offline.parse_args(["throughput", "--model", str(path), "--max-total-tokens", "16384"])
    engine = offline.make_engine(args)
    modes: list[bool] = []
    launch, sample_step = engine.runner.forward, engine.sampler.sample

    def strict(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return wrapped

    def counted(plan: Any, *args: Any, **kwargs: Any) -> Any:
        modes.append(plan.is_decode)
        return strict(launch)(plan, *args, **kwargs)

    engine.runner.forward = counted  # type: ignore[method-assign]
    engine.sampler.sample = strict(sample_step)  # type: ignore[method-assign]
    reqs = [offline.request("long", [(5 * i) % 200 + 3 for i in range(100)], 6)]
    reqs.append(offline.request("short", [(3 * i) % 200 + 3 for i in range(30)], 6))
    done = offline.drain(engine, reqs)
    assert done.tokens_by_rid == {"long": 6, "short": 6} and done.finished == 2
    assert False in modes and True in modes  # both an EXTEND and a DECODE were launched
