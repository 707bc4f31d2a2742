"""fp8 experts' grouped launches at decode sizes (kernels/fused_moe.py), against bf16, cold:
Qwen3-30B-A3B's experts (128 of 768 x 2048, top 8) at 1 and 4 tokens, in bf16, with 128x128
block scales and with a scale per row, each launch replayed over COPIES layers' experts in
turn in one CUDA graph, so that each call reads its experts from memory as a decode step does
(one layer's 8 experts fit the 50 MB L2). Every tile configuration of TILES that a format
takes (block scales: BLOCK_N and BLOCK_K dividing 128), fastest first, with the default
(`choose_tiles`) beside it and the bytes each call reads.

Batch-1 decode of the FP8 layout gained 3% over bf16 on an H200 where its bytes would give
about 1.2x of the step (`--sections qwen3moe_fp8`); this measures the launches alone.
"""

from __future__ import annotations

from typing import Any

import torch

from loadtest.gpu.moe import QWEN3_30B_A3B, TILE_ARGS

COPIES = 6  # layers' experts replayed in turn: 6 x 8 experts, far past the L2 at every format
TOKENS = (1, 4)
TILES = [
    (16, 32, 128, 4, 3),
    (16, 64, 128, 4, 3),
    (16, 16, 128, 4, 3),
    (16, 128, 128, 4, 3),
    (16, 32, 64, 4, 4),
    (16, 64, 64, 2, 4),
    (16, 32, 128, 2, 3),
    (16, 64, 128, 8, 3),
    (16, 32, 256, 4, 3),  # bf16 and row scales only: a 256-deep tile spans two blocks
]
FORMATS = ("bf16", "fp8_block", "fp8_rows")


def experts(
    fmt: str, gen: torch.Generator, cfg: dict[str, Any] = QWEN3_30B_A3B, device: str = "cuda"
) -> tuple[torch.Tensor, ...]:
    """One layer's experts in `fmt`: (w13, w2) or (w13, w2, w13_scale, w2_scale)."""
    from kernels.fused_moe import quantize_experts

    e, h, i = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    w13 = torch.randn(e, 2 * i, h, device=device, generator=gen).mul_(0.02)
    w2 = torch.randn(e, h, i, device=device, generator=gen).mul_(0.02)
    if fmt == "bf16":
        return w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    return quantize_experts(w13, w2, rows=fmt == "fp8_rows")


def fits(fmt: str, tiles: tuple[int, ...]) -> bool:
    """Whether `fmt` takes these tiles (block scales: BLOCK_N and BLOCK_K dividing 128)."""
    _, bn, bk, _, _ = tiles
    return fmt != "fp8_block" or (128 % bn == 0 and 128 % bk == 0)


def moe_fp8_tiles_section() -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "copies": COPIES}
    for fmt in FORMATS:
        out.update(_format_rows(fmt, gen))
        torch.cuda.empty_cache()  # this format's copies, before the next one's
    return out


def _format_rows(fmt: str, gen: torch.Generator) -> dict[str, Any]:
    """Each token count's default launch and every tile configuration `fmt` takes."""
    from kernels.fused_moe import fused_moe
    from loadtest.gpu.mla_kernel import graph_seconds

    cfg = QWEN3_30B_A3B
    e, top_k, h = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    layers = [experts(fmt, gen) for _ in range(COPIES)]
    per_expert = (layers[0][0].nbytes + layers[0][1].nbytes) // e
    out: dict[str, Any] = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(tokens, e, device="cuda", generator=gen)
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        read = int(torch.unique(ids).numel()) * per_expert

        def timed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **tiles: Any) -> float:
            def run() -> None:
                for layer in layers:
                    s13, s2 = (layer[2], layer[3]) if len(layer) > 2 else (None, None)
                    fused_moe(x, layer[0], layer[1], weights, ids, w13_scale=s13, w2_scale=s2,
                              **tiles)  # fmt: skip

            return graph_seconds(run, reps=2) / COPIES * 1e6

        rows = []
        for tiles in TILES:
            if fits(fmt, tiles):
                try:
                    us = timed(x, weights, ids, **dict(zip(TILE_ARGS, tiles, strict=True)))
                    rows.append({"tiles": list(tiles), "us": us, "GBps": read / us / 1e3})
                except Exception as err:  # a configuration the GPU cannot hold
                    rows.append({"tiles": list(tiles), "error": str(err)[:120]})
        rows.sort(key=lambda r: r.get("us", float("inf")))
        default = timed(x, weights, ids)
        out[f"{fmt} t{tokens}"] = {
            "default_us": default, "bytes_read": read, "default_GBps": read / default / 1e3,
            "tiles": rows,
        }  # fmt: skip
        print(f"moe_fp8_tiles {fmt} {tokens} tokens: default {default:.1f} us, best "
              f"{rows[0]}", flush=True)  # fmt: skip
    return out


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """gpu_bench's summary lines: each format and token count's default and best launch."""
    rows = []
    for key, r in result.items():
        if not isinstance(r, dict) or "default_us" not in r:
            continue
        best = next((t for t in r["tiles"] if "us" in t), None)
        line = f"default {r['default_us']:.1f} us ({r['default_GBps']:.0f} GB/s)"
        if best is not None:
            line += f", best {best['us']:.1f} us with {tuple(best['tiles'])}"
        rows.append((f"Qwen3-30B-A3B experts, {key.replace(' t', ', tokens ')}", line))
    return rows
