"""The int4 decode MMA (kernels/w4a16_mma.py) at Llama-3.1-8B's projection shapes against the
plain layout's kernels it replaced on the GPU, cold weights (COLD_BYTES of copies, replayed in
turn in one CUDA graph, so that each launch reads its weight from memory as a decode step
does, not from the 50 MB L2).

For each projection (qkv, o, gate_up, down) and row count of x in ROWS: the MMA's default
launch and every launch of SPLITS x AHEADS x ZSUBS (warps splitting K, chunks of words in
flight, the zero points inside A or by MMAs against ones), the best of them, the int4 GEMV's
best launch (up to 4 rows, the start-up timing's candidates) or the tensor-core GEMM (5 to 64
rows), bf16 cuBLAS, and the MMA's largest difference from the fp32 twin relative to the
largest output. Summed over the four projections
per row count, each is what a decode step's projections take. Then the prefill expansion of
each weight to bf16 from the plain words (kernels/w4a16_dequant) and from the shuffled ones
(kernels/w4a16_mma_dequant), and whether their bits agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loadtest.gpu.w4a16 import GROUP, LLAMA_8B

ROWS = (1, 2, 4, 8, 16, 32, 64)
SPLITS = (2, 4, 8)  # 1 was never the best at any shape or row count (run4)
AHEADS = (2, 4, 8)
ZSUBS = (False, True)
COLD_BYTES = 400 * 2**20  # int4 words replayed in turn, against a 50 MB L2


def _cold_us(weights: Sequence[tuple[torch.Tensor, ...]], fn: Callable[..., object]) -> float:
    """Microseconds per call of fn(*w), each call on the next copy of the weights."""
    from loadtest.gpu.mla_kernel import graph_seconds

    return graph_seconds(lambda: [fn(*w) for w in weights], reps=1) / len(weights) * 1e6


def _at_rows(
    x: torch.Tensor,
    words: dict[str, Any],
    plain: Sequence[tuple[torch.Tensor, ...]],
    shuffled: Sequence[tuple[torch.Tensor, ...]],
    dense: Sequence[tuple[torch.Tensor, ...]],
) -> dict[str, Any]:
    """The kernels' cold times and the MMA's error at one row count (x's rows); dense: bf16
    copies of a weight of the shape, replayed in turn as the int4 ones are."""
    from kernels._checks import sm_count
    from kernels.gemv import MAX_M as GEMV_MAX_M
    from kernels.w4a16 import w4a16_ref
    from kernels.w4a16_gemm import w4a16_gemm
    from kernels.w4a16_gemv import w4a16_gemv
    from kernels.w4a16_mma import (
        mma_ahead,
        mma_split,
        split_at_most,
        w4a16_mma,
        zsub_default,
    )
    from services.executor.quant.int4_linear import INT4_CANDIDATES

    m, k = x.shape
    qweight, qmma, scales, zeros = words["qweight"], words["qmma"], words["scales"], words["zeros"]
    out = torch.empty(m, qweight.shape[0], dtype=x.dtype, device=x.device)
    want = w4a16_ref(x.float(), qweight, scales.float(), zeros, group_size=GROUP)
    got = w4a16_mma(x, qmma, scales, zeros, group_size=GROUP).float()

    def mma(
        q: torch.Tensor,
        s: torch.Tensor,
        z: torch.Tensor,
        split: int | None = None,
        ahead: int | None = None,
        zsub: bool | None = None,
    ) -> None:
        w4a16_mma(x, q, s, z, group_size=GROUP, out=out, split=split, ahead=ahead, zsub=zsub)

    row: dict[str, Any] = {
        "mma_rel_err": float((got - want).abs().max() / want.abs().max()),
        "bf16_us": _cold_us(dense, lambda w: F.linear(x, w)),
    }
    by_launch = {
        (split, ahead, zsub): _cold_us(shuffled, partial(mma, split=split, ahead=ahead, zsub=zsub))
        for split in SPLITS
        for ahead in AHEADS
        for zsub in ZSUBS
        if split_at_most(k, GROUP, split) == split
    }
    row["mma_us"] = {
        f"split {s} ahead {a} zsub {int(z)}": us for (s, a, z), us in by_launch.items()
    }
    # The default launch (`mma_split`, `mma_ahead`, `zsub_default`) read from the grid where
    # it is there: timed on its own, first, it read 5-10% slower than the same launch in the
    # grid (gpu_w4a16_mma_h200_run6.json, one row of x).
    n = qmma.shape[0] * 16
    split = mma_split(k, GROUP, n, sm_count(x.device), m)
    default = (split, mma_ahead(m), zsub_default(m, n, split, sm_count(x.device)))
    row["mma_default"] = f"split {default[0]} ahead {default[1]} zsub {int(default[2])}"
    row["mma_default_us"] = by_launch.get(default) or _cold_us(shuffled, mma)
    best = min(by_launch, key=by_launch.__getitem__)
    row["mma_best_us"] = by_launch[best]
    row["mma_best_split"], row["mma_best_ahead"], row["mma_best_zsub"] = best
    if m <= GEMV_MAX_M:

        def gemv(c: Any) -> Callable[..., object]:
            return lambda q, s, z: w4a16_gemv(
                x, q, s, z, group_size=GROUP, out=out, block_n=c.block_n, block_k=c.block_k,
                num_warps=c.num_warps, num_stages=c.num_stages,
            )  # fmt: skip

        row["gemv_best_us"] = min(_cold_us(plain, gemv(c)) for c in INT4_CANDIDATES)
    else:
        row["gemm_us"] = _cold_us(plain, partial(w4a16_gemm, x, group_size=GROUP, out=out))
    return row


def _shape(n: int, k: int, gen: torch.Generator) -> dict[str, Any]:
    from kernels.w4a16_dequant import w4a16_dequantize
    from kernels.w4a16_mma import shuffle_w4
    from kernels.w4a16_mma_dequant import w4a16_mma_dequantize

    groups = k // GROUP
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", generator=gen,
                            dtype=torch.int32)  # fmt: skip
    scales = (torch.rand(n, groups, device="cuda", generator=gen) * 0.01).half()
    zeros = torch.randint(0, 16, (n, groups), device="cuda", generator=gen).to(torch.uint8)
    qmma = shuffle_w4(qweight)
    words = {"qweight": qweight, "qmma": qmma, "scales": scales, "zeros": zeros}
    copies = max(1, -(-COLD_BYTES // (n * k // 2)))
    plain = [(qweight, scales, zeros)]
    plain += [(qweight.clone(), scales.clone(), zeros.clone()) for _ in range(copies - 1)]
    shuffled = [(qmma, scales, zeros)]
    shuffled += [(qmma.clone(), scales.clone(), zeros.clone()) for _ in range(copies - 1)]
    first = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).bfloat16()
    dense = [(first,)] + [(first.clone(),) for _ in range(max(1, -(-COLD_BYTES // (2 * n * k))))]
    rows = {}
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        rows[str(m)] = _at_rows(x, words, plain, shuffled, dense)
        print(f"[{n} x {k}, {m} rows] {rows[str(m)]}", flush=True)  # the log keeps what ran
    expanded = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    a = w4a16_dequantize(qweight, scales, zeros, group_size=GROUP, out=expanded).clone()
    b = w4a16_mma_dequantize(qmma, scales, zeros, group_size=GROUP, out=expanded)
    expansion = {
        "plain_us": _cold_us(plain, partial(w4a16_dequantize, group_size=GROUP, out=expanded)),
        "shuffled_us": _cold_us(
            shuffled, partial(w4a16_mma_dequantize, group_size=GROUP, out=expanded)
        ),
        "same_bits": bool(torch.equal(a, b)),
    }
    return {"rows": rows, "expansion": expansion}


def w4a16_mma_section() -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    projections = {}
    for name, (n, k) in LLAMA_8B.items():
        projections[name] = _shape(n, k, gen)
        torch.cuda.empty_cache()
    return {
        "gpu": torch.cuda.get_device_name(),
        "projections": projections,
        "layer": layer_sums(projections),
    }


def layer_sums(projections: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per row count, the four projections' time summed for each kernel measured at it."""
    sums: dict[str, dict[str, float]] = {}
    for p in projections.values():
        for m, row in p["rows"].items():
            into = sums.setdefault(m, {})
            for key in ("mma_default_us", "mma_best_us", "gemv_best_us", "gemm_us", "bf16_us"):
                if key in row:
                    into[key] = into.get(key, 0.0) + row[key]
    return sums


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """gpu_bench's summary lines for this section."""
    rows: list[tuple[str, str]] = []
    for m, s in result.get("layer", {}).items():
        old = s.get("gemv_best_us", s.get("gemm_us"))
        kind = "GEMV" if "gemv_best_us" in s else "GEMM"
        line = f"MMA {s['mma_default_us']:.1f} us (best launch {s['mma_best_us']:.1f})"
        if old is not None:
            line += f", int4 {kind} {old:.1f} us"
        rows.append(
            (f"int4 projections of a layer, {m} row(s)", f"{line}, bf16 {s['bf16_us']:.1f} us")
        )
    for name, p in result.get("projections", {}).items():
        e = p["expansion"]
        same = "same bits" if e["same_bits"] else "BITS DIFFER"
        rows.append(
            (
                f"int4 expansion {name}",
                f"shuffled {e['shuffled_us']:.1f} us, plain {e['plain_us']:.1f} us ({same})",
            )
        )
    return rows
