"""The host must never wait for the device while it prepares a step: a blocking copy in the
sampler stops the CPU work of step N+1 until the forward pass of step N is done. CUDA's sync
debug mode turns every synchronising call into an error."""

from __future__ import annotations

import pytest
import torch

from services.executor.sampler import SamplingTensors, sample
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
