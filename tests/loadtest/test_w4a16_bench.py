"""gpu_bench's w4a16_kernel summary lines, from a section result of the shape it writes."""

from __future__ import annotations

from loadtest.gpu.w4a16 import table_rows


def test_table_rows() -> None:
    gemv_row = {"bf16_us": 30.0, "int4_us": 10.0, "speedup": 3.0, "int4_of_copy": 0.75}
    result = {
        "gemv": {"down": {"1": gemv_row, "1_act_order": gemv_row, "skipped": ["(4, 1, 8, 3): x"]}},
        "layer_projections_1row": {"bf16_us": 90.0, "int4_us": 30.0, "speedup": 3.0},
        "gemm": {"o": {"128": {"int4_us": 40.0, "int4_over_bf16_time": 1.25}}},
    }
    assert table_rows(result) == [
        ("int4 GEMV down, 1 row(s)", "10.0 us vs bf16 30.0 us = 3.00x, 75% of copy bandwidth"),
        (
            "int4 GEMV down, 1 row(s), act-order",
            "10.0 us vs bf16 30.0 us = 3.00x, 75% of copy bandwidth",
        ),
        ("int4 vs bf16, a layer's projections at 1 row", "3.00x"),
        ("int4 GEMM o, 128 rows", "40 us = 1.25x bf16's time"),
    ]
    assert table_rows({"error": "exit 1"}) == []
