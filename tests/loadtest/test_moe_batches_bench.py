"""gpu_bench's qwen3moe_batches and dsv2lite_batches sections: registered, and their summary
lines from a result of the shape decode_batches writes (the timings need a GPU)."""

from __future__ import annotations

import pytest

from loadtest import gpu_bench


def test_the_gpu_table_shows_each_batch_size_step_and_throughput() -> None:
    batches = {
        "1": {"decode_step_ms_mean": 2.6668, "decode_tok_s": 375.0},
        "4": {"decode_step_ms_mean": 5.3601, "decode_tok_s": 746.3},
    }
    results = {"dsv2lite_batches": {"gpu": "test", "batches": batches}}
    lines = gpu_bench.table(results).splitlines()
    at = {
        bs: [line for line in lines if f"DeepSeek-V2-Lite decode at batch {bs} " in line]
        for bs in ("1", "4")
    }
    assert at["1"] and at["1"][0].endswith("2.667 ms a step, 375 tok/s"), lines
    assert at["4"] and at["4"][0].endswith("5.360 ms a step, 746 tok/s"), lines
    assert not any("Qwen3-30B-A3B decode at batch" in line for line in lines)


@pytest.mark.parametrize("section", ["qwen3moe_batches", "dsv2lite_batches"])
def test_the_sections_are_known(section: str) -> None:
    assert section in gpu_bench.TIME_LIMITS
    with pytest.raises(SystemExit, match=rf"known: .*\b{section}\b"):
        gpu_bench.run_section("no-such-section", None)  # type: ignore[arg-type]


def test_the_fp8_section_reports_each_batch_both_ways_and_the_ratio() -> None:
    from loadtest.gpu.moe import QWEN3_30B_A3B, fp8_step_bytes, step_bytes

    def batches(tok_s: float) -> dict[str, dict[str, float]]:
        return {"1": {"decode_tok_s": tok_s, "decode_step_ms_mean": 1000 / tok_s}}

    result = {
        "bf16": {"batches": batches(350.0), "share_of_roofline": 0.5, "roofline_tok_s": 700.0},
        "fp8_block": {"batches": batches(525.0)},
        "ratio_by_batch": {"1": 1.5},
    }
    lines = gpu_bench.table({"qwen3moe_fp8": result}).splitlines()
    assert any(line.endswith("525 tok/s against bf16's 350: 1.50x") for line in lines), lines
    assert any(line.endswith("50.0% of 700 tok/s") for line in lines), lines
    assert "qwen3moe_fp8" in gpu_bench.TIME_LIMITS
    # e4m3 halves the projections' and experts' bytes; the router, LM head and cache stay
    read = step_bytes(QWEN3_30B_A3B, 256, 8)
    halved = (read["attention"] + read["experts"]) // 2
    assert fp8_step_bytes(read) == read["total"] - halved + halved // 4096
