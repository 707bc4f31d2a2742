"""The CPU tensor-parallel benchmark: the same tokens on two ranks, and every collective of a
step counted where rank 0 makes it (a tiny Llama of 2 layers: two row-parallel all-reduces a
layer and the embedding's, one logits all-gather, one table send a forward pass)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import tp_cpu


def test_two_ranks_same_tokens_and_every_collective_counted(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    report = tp_cpu.main(
        ["--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--out", str(out)]
    )
    assert report["same_tokens"] is True
    calls = report["collective_calls"]
    forwards = calls["send"]
    assert forwards > 0
    assert calls["all_reduce"] == forwards * (2 * 2 + 1)
    assert calls["all_gather_last"] == forwards
    assert 0 < report["collective_share_of_step"] < 1
    assert json.loads(out.read_text())["collective_calls"] == calls
