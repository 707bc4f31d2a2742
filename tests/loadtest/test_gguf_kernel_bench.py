"""gpu_bench's gguf_kernel section: its summary lines (the timings need a GPU)."""

from __future__ import annotations

from loadtest import gpu_bench


def test_the_gpu_table_shows_each_types_projection_speed_and_the_rows_past_it() -> None:
    layer = {"projections_tok_s": 150.0, "projections_roofline_tok_s": 200.0, "layer_us": 1.0}
    results = {
        "gguf_kernel": {
            "layer": {"Q4_K": layer, "bf16": {**layer, "projections_tok_s": 60.0}},
            "matmul": {"rows": {"8": {"expand_cublas_us": 150.25, "expand_over_bf16_time": 2.5}}},
        }
    }
    lines = gpu_bench.table(results).splitlines()
    assert any(
        "batch 1, Q4_K" in line and "150 tok/s = 75% of roofline 200" in line for line in lines
    )
    assert any("batch 1, bf16" in line and "60 tok/s = 30%" in line for line in lines), lines
    want = "150.2 us, 2.50x bf16's time"
    assert any("gate_up, 8 rows" in line and want in line for line in lines), lines
    assert "gguf_kernel" in gpu_bench.TIME_LIMITS
