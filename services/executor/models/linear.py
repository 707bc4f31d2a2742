"""Projections that take kernels/gemv for the few-row products of small decode batches, where
it reads the weight faster than cuBLAS, and cuBLAS everywhere else.

Which one is faster depends on the GPU and the shape, so nothing is assumed: `choose_gemv`
times both on the device at start (before the model's CUDA graphs are captured, each inside
a graph of its own, as decode runs them) for every projection shape of the model and every
row count up to kernels.gemv.MAX_M, and each `Linear` keeps the winner per row count. The
executor keeps the choices between starts (gemv_plans.py), so a later start on the same GPU
and code times nothing. Without a choice (the CPU, tests) a `Linear` is nn.Linear.

What a Linear holds and how it multiplies is its `method` (quant/base.py): `UNQUANTIZED` here,
or a quantized format's (fp8 weights and scales), given by quant/apply.py after the model is
built; the timing above compares each method's own skinny kernel with its own dense product.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels.compile_ahead import compile_ahead
from services.executor.distributed.shard import WHOLE, LoadPlan
from services.executor.models.gemv_plans import PlanStore
from services.executor.quant.base import LinearMethod

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # fp8 weights: kernels/fp8_gemv_packed.py (fp16x2 products) where it takes the product
    packed: bool = False
    # int4 weights: kernels/w4a16_mma.py (the tensor cores' MMA), num_warps warps a tile and
    # num_stages chunks of words loaded ahead
    mma: bool = False

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x @ weight.T through kernels/gemv with this launch configuration (out in
        out_dtype: x's, or float32)."""
        from kernels.gemv import gemv

        return gemv(
            x,
            weight,
            block_n=self.block_n,
            block_k=self.block_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            out_dtype=out_dtype,
        )


# Launch configurations tried against cuBLAS: rows per program x columns per step.
CANDIDATES = (
    GemvConfig(8, 512, 4, 3),
    GemvConfig(16, 256, 4, 3),
    GemvConfig(4, 512, 4, 4),
    # fewer rows a program, deeper K steps: more programs for the small projections of MoE
    # and MLA models (2,048 to 5,120 outputs), whose last wave otherwise runs half empty
    GemvConfig(4, 1024, 4, 3),
    GemvConfig(2, 1024, 4, 4),
    GemvConfig(8, 1024, 8, 3),
)


class Unquantized(LinearMethod):
    """The weight in the model's dtype: cuBLAS, or kernels/gemv for the planned row counts."""

    def dense(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def gemv(self, layer: Linear, x: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        return cfg(x, layer.weight)


UNQUANTIZED = Unquantized()


class Fp32Products(Unquantized):
    """The weight in the model's dtype, the product in fp32: F.linear(x.float(),
    w.float()), as DeepSeek's checkpoints compute router logits. Decode's few rows take
    kernels/gemv with an fp32 output (the same exact products, summed in fp32), so a step
    makes no widened copies of x and the weight and calls no fp32 cuBLAS kernel (four
    launches a layer, outside the PDL chain, that cost DeepSeek-V2-Lite about 0.25 ms a
    batch-1 step on an H100)."""

    name = "fp32-products"

    def dense(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.float(), layer.weight.float(), None if bias is None else bias.float())

    def gemv(self, layer: Linear, x: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        return cfg(x, layer.weight, out_dtype=torch.float32)


FP32_PRODUCTS = Fp32Products()


class Linear(nn.Linear):
    """nn.Linear whose product is its `method`'s: the gemv kernel for the row counts in
    `gemv_plan`, the method's dense product for the others."""

    # False: kept in the model dtype whatever the checkpoint's format (LM head, MoE router)
    quantizable = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_plan: dict[int, GemvConfig] = {}  # rows of x -> the kernel's configuration
        self.method: LinearMethod = UNQUANTIZED
        # False once another module's product replaces this one's (its weight a view of that
        # module's): nothing calls it, so choose_gemv does not time it
        self.in_use = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    @property
    def plain(self) -> bool:
        """Whether the product is the weight alone, as it is (no quantized format, no bias):
        what may be copied or concatenated into another module's weight."""
        return self.method is UNQUANTIZED and self.bias is None

    def load_plan(self, kind: str, index: int | None) -> LoadPlan:
        """Every row of every tensor (the sharded subclasses say otherwise)."""
        return 0, self.out_features, WHOLE


def _time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds per call of `fn`, replayed from a CUDA graph of `reps` calls (median
    of three replays). Decode runs its projections inside CUDA graphs, where a launch costs
    the host nothing: timed eagerly, a short kernel would be judged by its launcher's host
    overhead (Triton's is several times torch's), and cuBLAS would win shapes it loses."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compiles; allocations settle before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end) / reps)
    del graph
    return sorted(times)[1]


def _launches(layer: Linear, act_dtype: torch.dtype | None) -> list[Callable[[], object]]:
    """Every product `_plan` times for `layer`, once each, for compile_ahead: its gemv
    candidates at each row count, and its dense product where that is a Triton kernel too (a
    quantized format's; the unquantized ones are cuBLAS, with nothing to compile), there also
    at the decode batches' row counts its kernels specialise by (`dense_ahead_rows`), which
    the CUDA graphs' capture would otherwise compile one after another."""
    from kernels.gemv import MAX_M

    method, w = layer.method, layer.weight
    dtype = act_dtype or w.dtype

    def call(m: int, cfg: GemvConfig | None) -> None:
        x = torch.randn(m, layer.in_features, dtype=dtype, device=w.device)
        if cfg is None:
            method.dense(layer, x, None)
        else:
            method.gemv(layer, x, cfg)

    dense: list[GemvConfig | None] = [] if isinstance(method, Unquantized) else [None]
    cfgs = [*dense, *method.gemv_candidates(layer)]
    calls: list[Callable[[], object]] = [
        partial(call, m, cfg) for m in range(1, MAX_M + 1) for cfg in cfgs
    ]
    return calls + [partial(call, m, None) for m in method.dense_ahead_rows(layer)]


def _plan(layer: Linear, dtype: torch.dtype) -> tuple[dict[int, GemvConfig], float]:
    """The faster gemv configuration per row count, where one beats the layer's dense
    product, and the microseconds saved over row counts 1 to MAX_M; x in `dtype`."""
    from kernels.gemv import MAX_M

    method, device = layer.method, layer.weight.device
    plan: dict[int, GemvConfig] = {}
    saved = 0.0
    for m in range(1, MAX_M + 1):
        x = torch.randn(m, layer.in_features, dtype=dtype, device=device)
        dense_us = best_us = _time_us(partial(method.dense, layer, x, None))
        for cfg in method.gemv_candidates(layer):
            try:
                us = _time_us(partial(method.gemv, layer, x, cfg))
            except Exception as e:  # e.g. out of shared memory on this GPU: skip it
                log.warning("gemv %s does not run for %s: %s", cfg, tuple(layer.weight.shape), e)
                continue
            if us < best_us:
                best_us, plan[m] = us, cfg
        saved += dense_us - best_us
    return plan, saved


def planned_layers(model: nn.Module) -> list[Linear]:
    """The Linear modules of `model` whose products a forward calls (`in_use`)."""
    return [m for m in model.modules() if isinstance(m, Linear) and m.in_use]


ShapeKey = tuple[int, int, torch.dtype, str]  # the weight's [N, K], its dtype, its format


def _on_gpu(layer: Linear) -> bool:
    """Whether choose_gemv times `layer` (tests replace it to run the choice on the CPU)."""
    return layer.weight.is_cuda


def _shape_key(layer: Linear) -> ShapeKey:
    w = layer.weight
    return w.shape[0], w.shape[1], w.dtype, layer.method.name


@torch.inference_mode()
def choose_gemv(
    model: nn.Module, act_dtype: torch.dtype | None = None, store: PlanStore | None = None
) -> dict[str, float]:
    """Time the dense product and each gemv configuration for every distinct projection
    shape, weight format and row count; give each Linear the kernel where it wins. Returns
    microseconds saved per weight shape ("NxK", with the format when quantized), summed
    over row counts (for the log). act_dtype: the activations' dtype (None: the weight's,
    which a quantized format's weight is not). store: the choices earlier starts on this GPU
    saved (gemv_plans.py), taken for the shapes it has and given the ones timed here; None:
    every shape is timed."""
    from kernels.gemv import MAX_M

    layers = [layer for layer in planned_layers(model) if _on_gpu(layer)]
    shapes: dict[ShapeKey, Linear] = {}
    for layer in layers:
        shapes.setdefault(_shape_key(layer), layer)
    plans: dict[ShapeKey, dict[int, GemvConfig]] = {}
    saved: dict[str, float] = {}
    timed: dict[ShapeKey, Linear] = {}
    for key, layer in shapes.items():
        hit = store.get(_stored_label(key, act_dtype)) if store is not None else None
        if hit is None:
            timed[key] = layer
        else:
            plans[key], saved[_label(key)] = hit
    if timed:
        calls = [c for layer in timed.values() for c in _launches(layer, act_dtype)]
        compile_ahead(calls, next(iter(timed.values())).weight.device)
    for key, layer in timed.items():
        plans[key], saved[_label(key)] = _plan(layer, act_dtype or layer.weight.dtype)
        if store is not None:
            store.put(_stored_label(key, act_dtype), plans[key], saved[_label(key)])
    if store is not None:
        store.save()
    for layer in layers:
        layer.gemv_plan = dict(plans[_shape_key(layer)])
    for key in shapes:
        how = "timed" if key in timed else "saved choice"
        log.info(
            "gemv for %s: %.1f us saved per call over row counts 1-%d (%s)",
            _label(key), saved[_label(key)], MAX_M, how,
        )  # fmt: skip
    return saved


def _label(key: ShapeKey) -> str:
    """The log's name for a shape: NxK, with the format when quantized."""
    return f"{key[0]}x{key[1]}" + ("" if key[3] == UNQUANTIZED.name else f" {key[3]}")


def _stored_label(key: ShapeKey, act_dtype: torch.dtype | None) -> str:
    """The store's name for a shape: everything its timing depended on."""
    n, k, dtype, method = key
    return f"{n}x{k} {method} w={dtype} x={act_dtype or dtype}"
