"""gpu_bench's moe_fp8_tiles section: registered, its experts in the layouts fused_moe takes
(run here in Triton's interpreter at a tiny shape against the dequantized twin), the tiles
each format takes, and its summary lines (the timings need a GPU)."""

from __future__ import annotations

import pytest
import torch

from loadtest import gpu_bench
from loadtest.gpu.moe_fp8 import FORMATS, TILES, experts, fits, table_rows

TINY = {"num_experts": 4, "hidden_size": 256, "moe_intermediate_size": 160}


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_formats_experts_run_in_fused_moe(fmt: str) -> None:
    from kernels.fused_moe import fused_moe, fused_moe_ref

    gen = torch.Generator().manual_seed(0)
    layer = experts(fmt, gen, TINY, "cpu")
    if fmt == "bf16":  # the interpreter's bf16 products are not exact; the layout is the check
        layer = tuple(t.float() for t in layer)
    x = torch.randn(3, 256, generator=gen)
    weights, ids = torch.randn(3, 4, generator=gen).softmax(-1).topk(2, dim=-1)
    s13, s2 = (layer[2], layer[3]) if len(layer) > 2 else (None, None)
    out = fused_moe(x, layer[0], layer[1], weights, ids, block_m=16, block_n=32, block_k=64,
                    w13_scale=s13, w2_scale=s2)  # fmt: skip
    want = fused_moe_ref(x, layer[0], layer[1], weights, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_block_scales_take_only_tiles_inside_one_block() -> None:
    assert all(fits("bf16", t) and fits("fp8_rows", t) for t in TILES)
    assert [t for t in TILES if not fits("fp8_block", t)] == [(16, 32, 256, 4, 3)]


def test_the_section_is_known_and_summarised() -> None:
    assert "moe_fp8_tiles" in gpu_bench.TIME_LIMITS
    result = {
        "gpu": "test",
        "fp8_block t1": {
            "default_us": 30.0, "default_GBps": 1250.0, "bytes_read": 37_748_736,
            "tiles": [{"tiles": [16, 64, 128, 4, 3], "us": 25.0, "GBps": 1510.0}],
        },
    }  # fmt: skip
    lines = gpu_bench.table({"moe_fp8_tiles": result}).splitlines()
    assert any(
        "experts, fp8_block, tokens 1" in line
        and line.endswith("default 30.0 us (1250 GB/s), best 25.0 us with (16, 64, 128, 4, 3)")
        for line in lines
    ), lines
    assert table_rows({"gpu": "x"}) == []
