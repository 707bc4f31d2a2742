"""gpu_bench's w4a16_mma summaries (the per-layer sums and the table lines) from results of the
shape it writes, and the quantized decode sections' KV pools."""

from __future__ import annotations

from loadtest.gpu.quant import SECTIONS, pool_tokens
from loadtest.gpu.w4a16_mma import layer_sums, table_rows


def _row(mma: float, old_key: str, old: float) -> dict[str, float]:
    return {"mma_default_us": mma, "mma_best_us": mma - 1, old_key: old, "bf16_us": 10.0}


def test_layer_sums_and_table_rows() -> None:
    projections = {
        name: {
            "rows": {"1": _row(5.0, "gemv_best_us", 6.0), "8": _row(6.0, "gemm_us", 12.0)},
            "expansion": {"plain_us": 20.0, "shuffled_us": 24.0, "same_bits": name == "o"},
        }
        for name in ("qkv", "o")
    }
    sums = layer_sums(projections)
    assert sums == {
        "1": {"mma_default_us": 10.0, "mma_best_us": 8.0, "gemv_best_us": 12.0, "bf16_us": 20.0},
        "8": {"mma_default_us": 12.0, "mma_best_us": 10.0, "gemm_us": 24.0, "bf16_us": 20.0},
    }
    rows = table_rows({"projections": projections, "layer": sums})
    assert rows == [
        (
            "int4 projections of a layer, 1 row(s)",
            "MMA 10.0 us (best launch 8.0), int4 GEMV 12.0 us, bf16 20.0 us",
        ),
        (
            "int4 projections of a layer, 8 row(s)",
            "MMA 12.0 us (best launch 10.0), int4 GEMM 24.0 us, bf16 20.0 us",
        ),
        ("int4 expansion qkv", "shuffled 24.0 us, plain 20.0 us (BITS DIFFER)"),
        ("int4 expansion o", "shuffled 24.0 us, plain 20.0 us (same bits)"),
    ]
    assert table_rows({"error": "exit 1"}) == []


def test_every_decode_batch_fits_its_kv_pool() -> None:
    """A batch's requests all hold their whole context at once (batch 64: 64 x 384 tokens),
    where the sections' pool was 8,192 tokens for every batch size."""
    for section in SECTIONS.values():
        need = section.batch_size * (section.input_len + section.output_len)
        assert pool_tokens(section) >= max(need, 8192)
    assert pool_tokens(SECTIONS["quant_decode_batch64"]) > 8192
