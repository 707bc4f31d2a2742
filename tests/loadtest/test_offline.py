"""The offline benchmark drives the engine in-process and counts exactly what it asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import offline
from tests.executor.helpers import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("offline"), "qwen2", seed=1)


def test_throughput_counts_every_requested_token(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    rec = offline.main(
        [
            "throughput",
            "--model",
            str(tiny),
            "--num-prompts",
            "12",
            "--input-len",
            "40",
            "--output-len",
            "9",
            "--range-ratio",
            "0.5",
            "--output-file",
            str(out),
        ]
    )
    assert rec["requests"] == 12
    # ignore_eos: each request generates exactly its drawn output length, all in [4, 9].
    assert 12 * 4 <= rec["output_tokens"] <= 12 * 9
    assert 12 * 20 <= rec["input_tokens"] <= 12 * 40
    assert rec["output_tok_s"] == pytest.approx(rec["output_tokens"] / rec["elapsed_s"])
    assert json.loads(out.read_text().splitlines()[-1])["output_tokens"] == rec["output_tokens"]


def test_dummy_weights_need_only_a_config(tiny: Path, tmp_path: Path) -> None:
    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((tiny / "config.json").read_text())
    rec = offline.main(
        [
            "latency",
            "--model",
            str(cfg_only),
            "--load-format",
            "dummy",
            "--batch-size",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "5",
            "--output-file",
            str(tmp_path / "l.jsonl"),
        ]
    )
    assert rec["prefill_steps"] == 1
    assert rec["decode_steps"] == 4  # the first token comes from the prefill
    assert rec["decode_step_ms_mean"] > 0
