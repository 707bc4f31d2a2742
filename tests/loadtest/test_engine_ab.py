"""The Engine-vs-internal benchmark compares like with like: both paths run the same prompts
(the same lengths, whatever vocabulary each draws ids from) on one step engine, and each run
starts from an empty prefix cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadtest import offline
from loadtest.gpu.engine_ab import engine_ab
from loadtest.offline_prompts import throughput_prompts
from tests.executor.helpers import write_tiny_model


def test_prompt_lengths_do_not_depend_on_the_vocabulary() -> None:
    a = offline.parse_args(["throughput", "--num-prompts", "20", "--range-ratio", "0.0"])
    small = throughput_prompts(random.Random(3), a, 300)
    large = throughput_prompts(random.Random(3), a, 128_256)
    assert [(len(ids), n) for ids, n in small] == [(len(ids), n) for ids, n in large]
    assert all(10 <= t < 300 for ids, _ in small for t in ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("engine-ab"), "llama", seed=2)


def test_both_paths_run_the_same_work_from_a_cold_cache(tiny: Path) -> None:
    a = offline.parse_args(
        [
            "throughput",
            "--model",
            str(tiny),
            "--device",
            "cpu",
            "--num-prompts",
            "6",
            "--input-len",
            "24",
            "--output-len",
            "5",
            "--range-ratio",
            "0.5",
        ]
    )
    result = engine_ab(a, rounds=2)
    runs = result["runs"]
    assert [r["through"] for r in runs] == ["internal", "engine"] * 2
    for r in runs:
        assert r["finished"] == r["requests"] == 6
        assert (r["input_tokens"], r["output_tokens"]) == (
            runs[0]["input_tokens"],
            runs[0]["output_tokens"],
        )
        # Every prompt is prefilled, plus each run's 16-token warm-up: nothing came from the
        # previous run's cache.
        assert r["extend_tokens"] == r["input_tokens"] + 16
    assert "detokenize" in runs[1]["host_ms_per_step"]
