"""gpu_bench's w4a16_kernel summary lines, from a section result of the shape it writes."""

from __future__ import annotations

from loadtest.gpu.w4a16 import crossover, table_rows


def test_table_rows() -> None:
    gemv_row = {"bf16_us": 30.0, "int4_us": 10.0, "speedup": 3.0, "int4_of_copy": 0.75}
    result = {
        "gemv": {"down": {"1": gemv_row, "1_act_order": gemv_row, "skipped": ["(4, 1, 8, 3): x"]}},
        "layer_projections_1row": {"bf16_us": 90.0, "int4_us": 30.0, "speedup": 3.0},
        "prefill": {
            "projections": {
                "o": {
                    "dequant": {
                        "default_us": 20.0,
                        "default_GBps": 2500.0,
                        "default_of_copy": 0.6,
                        "best_of_copy": 0.7,
                    },
                    "rows": {
                        "128": {"gemm_us": 40.0, "dequant_cublas_us": 30.0, "bf16_cublas_us": 10.0}
                    },
                    "crossover_m": 128,
                }
            },
            "gemm_max_m": 127,
        },
    }
    assert table_rows(result) == [
        ("int4 GEMV down, 1 row(s)", "10.0 us vs bf16 30.0 us = 3.00x, 75% of copy bandwidth"),
        (
            "int4 GEMV down, 1 row(s), act-order",
            "10.0 us vs bf16 30.0 us = 3.00x, 75% of copy bandwidth",
        ),
        ("int4 vs bf16, a layer's projections at 1 row", "3.00x"),
        (
            "int4 dequantise o",
            "20 us, 2500 GB/s = 60% of copy bandwidth (best tile 70%)",
        ),
        ("int4 prefill o, 128 rows", "GEMM 40 us, dequantise + cuBLAS 30 us, bf16 cuBLAS 10 us"),
        ("int4 prefill o: dequantise + cuBLAS wins from rows", "128"),
        ("int4 prefill: GEMM_MAX_M to set (largest crossover - 1)", "127"),
    ]
    assert table_rows({"error": "exit 1"}) == []


def test_crossover_is_where_dequantise_and_cublas_win_from_on() -> None:
    def rows(*wins: bool) -> dict[str, dict[str, float]]:
        return {
            str(m): {"gemm_us": 10.0, "dequant_cublas_us": 5.0 if win else 20.0}
            for m, win in zip((16, 32, 128, 512), wins, strict=True)
        }

    assert crossover(rows(False, True, True, True)) == 32
    assert crossover(rows(True, False, True, True)) == 128  # a win below a loss is noise
    assert crossover(rows(True, True, True, True)) == 16
    assert crossover(rows(True, True, True, False)) is None
