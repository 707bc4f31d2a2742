"""The DP benchmark's plumbing on the CPU: the runs it plans, the serve commands and workload
flags it builds, the GPU section's split of the card, and the GPU table's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadtest import dp_bench, gpu_bench
from loadtest.flags import build_parser as serving_parser
from loadtest.gpu import dp
from loadtest.gpu.models import LLAMA_3_1_8B

H100_BYTES = 85_031_714_816  # what torch.cuda.mem_get_info reports as an 80 GB H100's total


def test_the_plan_runs_one_executor_then_each_method() -> None:
    runs = dp_bench.plan(2, ["cache_aware", "round_robin"], ["--device", "cpu"], 4096)
    assert [(r.name, r.serve_args) for r in runs] == [
        ("single", ["--device", "cpu"]),
        ("cache_aware", ["--device", "cpu", "--dp-size", "2", "--load-balance-method",
                         "cache_aware", "--max-total-tokens", "4096"]),
        ("round_robin", ["--device", "cpu", "--dp-size", "2", "--load-balance-method",
                         "round_robin", "--max-total-tokens", "4096"]),
    ]  # fmt: skip
    assert [r.name for r in dp_bench.plan(3, ["least_load"], [], single=False)] == ["least_load"]
    with pytest.raises(ValueError, match="unknown methods"):
        dp_bench.plan(2, ["random"], [])
    cmd = dp_bench.serve_command("m", 8123, runs[1])
    serve = [sys.executable, "-m", "radixserve", "serve", "--model", "m", "--port", "8123"]
    assert cmd == [*serve, *runs[1].serve_args]


def test_the_workload_reaches_the_serving_benchmark() -> None:
    a = dp_bench.build_parser().parse_args(["--model", "m", "--gsp-num-groups", "3"])
    served = serving_parser().parse_args(dp_bench.serving_args("http://h:1", "tok", a))
    assert (served.base_url, served.tokenizer) == ("http://h:1", "tok")
    assert served.backend == "radixserve"
    assert served.dataset_name == "generated-shared-prefix"
    assert (served.gsp_num_groups, served.gsp_prompts_per_group) == (3, 16)
    assert (served.gsp_system_prompt_len, served.gsp_question_len) == (2048, 128)
    assert served.gsp_output_len == 256 and served.request_rate == float("inf")  # all at once


def test_the_gpu_section_splits_the_card_and_runs_cache_aware_first(tmp_path: Path) -> None:
    # 0.85 of the card, less two copies of the weights (14.96 GiB each with the embedding),
    # in two pools of 128 KiB tokens.
    assert dp.kv_bytes_per_token(LLAMA_3_1_8B) == 131072
    assert dp.pool_tokens_each(H100_BYTES, 2, LLAMA_3_1_8B) == 153182
    with pytest.raises(ValueError, match="do not fit"):
        dp.pool_tokens_each(20 * 2**30, 2, LLAMA_3_1_8B)
    a = dp.bench_args(tmp_path / "model", 153182, tmp_path)
    assert a.out == tmp_path / "dp_runs.json" and a.log_dir == tmp_path
    assert (a.gsp_num_groups, a.gsp_prompts_per_group, a.gsp_output_len) == (64, 16, 256)
    runs = dp.runs(a)
    assert [r.name for r in runs] == ["cache_aware", "round_robin", "single"]
    front = ["--load-format", "dummy", "--gateway-replicas", "4"]  # the same for every run
    assert runs[0].serve_args == [*front, "--dp-size", "2",
                                  "--load-balance-method", "cache_aware",
                                  "--max-total-tokens", "153182"]  # fmt: skip
    assert runs[2].serve_args == front  # the whole card, by default


def test_the_gpu_table_shows_each_dp_run() -> None:
    def run(hit: float, tok_s: float) -> dict[str, object]:
        return {"cache_hit_rate": hit, "output_throughput": tok_s, "completed": 1024}

    results = {"dp": {"runs": {"cache_aware": run(0.874, 5000.0), "round_robin": run(0.8, 4000)}}}
    lines = gpu_bench.table(results).splitlines()
    assert any(
        "DP=2 on one GPU, cache_aware" in line and "87.4% cache hits, 5000 output tok/s" in line
        for line in lines
    ), lines
    assert any("round_robin" in line and "80.0% cache hits" in line for line in lines), lines
    assert "dp" in gpu_bench.TIME_LIMITS
