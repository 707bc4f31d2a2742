"""FP8 (e4m3fn) projections: per-channel scales (per-tensor checkpoints and --quantization fp8
run as per-channel) and 128x128 block scales. Layouts: kernels/fp8_weights.py.

On CUDA (compute capability 8.9+) the few-row products of decode read the fp8 weight through
kernels/fp8_gemv (when choose_gemv finds it faster), decode batches up to
kernels/fp8_gemm.GEMM_MAX_M rows through kernels/fp8_gemm (the weight widened on the tensor
cores' side, x as it is); larger ones quantize the activations per token (kernels/fp8_act_quant)
for torch._scaled_mm with row-wise scales, or per token and 128 columns for the block-scale GEMM
(kernels/fp8_block_gemm). Elsewhere (the CPU, shapes or dtypes _scaled_mm refuses) the weight is
dequantized and multiplied in torch.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_gemv_packed import PACKED_K
from kernels.fp8_weights import BLOCK, FP8, dequantize, quantize_blocks, quantize_rows
from services.executor.distributed.shard import WHOLE, LoadPlan, Shard
from services.executor.errors import ModelLoadError, UnsupportedQuantizationError
from services.executor.models.linear import CANDIDATES, GemvConfig, Linear
from services.executor.quant.base import LinearMethod, Slot

# activations of a dummy model with static input scales: |x| up to 448 * this
_DUMMY_INPUT_SCALE = 0.05


def _param(*shape: int, dtype: torch.dtype, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=like.device), requires_grad=False)


def copy_fp8(param: torch.Tensor, start: int, end: int, part: torch.Tensor) -> None:
    """A checkpoint's fp8 weight rows, refused in any other dtype: a cast would drop scales."""
    if part.dtype != FP8:
        raise ModelLoadError(
            f"is {part.dtype}; the checkpoint's quantization_config says float8_e4m3fn"
        )
    param[start:end].copy_(part)


def quantize_rows_into(
    weight: torch.Tensor, scales: torch.Tensor, start: int, end: int, part: torch.Tensor
) -> None:
    """--quantization fp8: a float checkpoint's rows quantized as they are copied into the
    fp8 `weight` (on its device), each row's scale into `scales` [rows, 1], so loading never
    holds more than the model and this one tensor."""
    q, scale = quantize_rows(part.to(weight.device))
    weight[start:end].copy_(q)
    scales[start:end].copy_(scale)


def _tensor(layer: Linear, name: str) -> torch.Tensor:
    t = getattr(layer, name)
    assert isinstance(t, torch.Tensor), name
    return t


def _rows_x(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _decode_batch(
    layer: Linear, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, blocks: bool
) -> torch.Tensor | None:
    """The product through kernels/fp8_gemm for a decode batch past the GEMV's rows (None for
    other row counts and devices)."""
    from kernels.fp8_gemm import GEMM_MAX_M, fp8_gemm
    from kernels.gemv import MAX_M

    rows = _rows_x(x)
    if not x.is_cuda or not MAX_M < rows.shape[0] <= GEMM_MAX_M:
        return None
    out = fp8_gemm(rows, layer.weight, scale, block_scales=blocks)
    out = out.view(*x.shape[:-1], layer.out_features)
    return out if bias is None else out + bias


# A weight is one byte: the bf16 candidates' steps, and each widened to the bytes a bf16 step
# reads (twice the columns), since a step of half the bytes leaves the copy engines idler.
# Then kernels/fp8_gemv_packed's launches (products in fp16 pairs): a warp's step is
# PACKED_K (512) columns, 16 a thread. On an H200 (2026-11-28,
# loadtest/results/gpu_fp8_packed_h200_run1.json) they won Llama-3.1-8B's qkv and gate_up at
# one row of x (gate_up 28.9 against 29.9 us) and every projection at two and four (gate_up
# at four 41.0 against 64.4 us). These are the ones that won a shape; each is a compile per
# row count at a cold start. (2, 4) won o and down at one row in a sweep of every block_n and
# warp count (loadtest/results/gpu_fp8_volatile_h200_run1.json, "micro_main": down 15.3 us
# against 16.3 for the best widening launch).
FP8_CANDIDATES = (
    CANDIDATES
    + tuple(GemvConfig(c.block_n, 2 * c.block_k, c.num_warps, c.num_stages) for c in CANDIDATES)
    + tuple(
        GemvConfig(block_n, warps * PACKED_K, warps, 3, packed=True)
        for block_n, warps in ((8, 1), (4, 1), (2, 2), (8, 4), (4, 4), (2, 4))
    )
)


class Fp8ChannelMethod(LinearMethod):
    """weight [N, K] fp8 and weight_scale [N, 1] fp32: row n is weight[n] * weight_scale[n].

    source: what the checkpoint holds. "channel": weight_scale [N, 1]; "tensor": one scale
    per tensor (each stacked part fills its rows with its own); "online": a float weight,
    quantized per row as it is copied in. static_input: the checkpoint's calibrated
    input_scale (one per stacked part; their largest quantizes the shared input), else
    each token's own scale."""

    name = "fp8"

    def __init__(self, source: str, static_input: bool = False) -> None:
        assert source in ("channel", "tensor", "online"), source
        self.source, self.static_input = source, static_input

    def create_weights(self, layer: Linear) -> None:
        like = layer.weight
        layer.weight = _param(layer.out_features, layer.in_features, dtype=FP8, like=like)
        scale = _param(layer.out_features, 1, dtype=torch.float32, like=like)
        layer.register_parameter("weight_scale", scale)
        if self.static_input:
            parts = len(getattr(layer, "parts", [()]))
            layer.register_parameter("input_scale", _param(parts, dtype=torch.float32, like=like))
            layer.register_buffer("act_scale", torch.empty(1, device=like.device), False)

    def slot(self, layer: Linear, kind: str, index: int | None, plan: LoadPlan) -> Slot | None:
        start, end, shard = plan
        if kind == "weight":
            if self.source == "online":
                fill = partial(quantize_rows_into, layer.weight, _tensor(layer, "weight_scale"))
                return Slot(start, end, shard, fill=fill)
            return Slot(start, end, shard, fill=partial(copy_fp8, layer.weight))
        if kind == "weight_scale":
            if self.source == "online":
                return None
            if self.source == "tensor":
                return Slot(start, end, WHOLE, scalar=True)
            # a row's scale covers all its columns: a rank of a row split reads all of them
            return Slot(start, end, shard if shard.dim == 0 else WHOLE)
        if kind == "input_scale":
            i = index or 0
            return Slot(i, i + 1, WHOLE, scalar=True)
        return Slot(*plan)

    def finish(self, layer: Linear) -> None:
        if self.static_input:
            _tensor(layer, "act_scale").copy_(_tensor(layer, "input_scale").max().reshape(1))

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        w = torch.empty(layer.weight.shape, device=layer.weight.device)
        q, scale = quantize_rows(w.normal_(0.0, 0.02, generator=gen))
        layer.weight.copy_(q)
        _tensor(layer, "weight_scale").copy_(scale)
        if self.static_input:
            _tensor(layer, "input_scale").fill_(_DUMMY_INPUT_SCALE)
            self.finish(layer)

    def dequantized(self, layer: Linear) -> torch.Tensor:
        return dequantize(layer.weight, _tensor(layer, "weight_scale"))

    def dense(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        batch = _decode_batch(layer, x, _tensor(layer, "weight_scale"), bias, blocks=False)
        if batch is not None:
            return batch
        n, k = layer.weight.shape
        # _scaled_mm: row-wise scales give bf16 only; both sizes multiples of 16
        if not x.is_cuda or x.dtype != torch.bfloat16 or n % 16 or k % 16:
            return F.linear(x, self.dequantized(layer).to(x.dtype), bias)
        from kernels.fp8_act_quant import quantize_act

        static = _tensor(layer, "act_scale") if self.static_input else None
        xq, xs = quantize_act(_rows_x(x), static_scale=static)
        out = torch._scaled_mm(
            xq,
            layer.weight.t(),
            scale_a=xs,
            scale_b=_tensor(layer, "weight_scale").view(1, n),
            bias=bias,
            out_dtype=x.dtype,
        )
        return out.view(*x.shape[:-1], n)

    def gemv_candidates(self, layer: Linear) -> tuple[GemvConfig, ...]:
        return FP8_CANDIDATES

    def gemv(self, layer: Linear, x: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        from kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(
            x, layer.weight, _tensor(layer, "weight_scale"),
            block_n=cfg.block_n, block_k=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, packed=cfg.packed,
        )  # fmt: skip


class Fp8BlockMethod(LinearMethod):
    """weight [N, K] fp8 and a scale per 128x128 block, [ceil(N/128), ceil(K/128)] fp32,
    under the checkpoint's name for it (`weight_scale_inv` in DeepSeek's and Qwen's releases,
    `weight_scale` in compressed-tensors'). Activations are quantized per token per 128
    columns (dynamic). Stacked parts and tensor-parallel slices must keep blocks whole."""

    name = "fp8-block"

    def __init__(self, scale_name: str = "weight_scale_inv") -> None:
        self.scale_name = scale_name

    def scale(self, layer: Linear) -> torch.Tensor:
        return _tensor(layer, self.scale_name)

    def create_weights(self, layer: Linear) -> None:
        _check_whole_blocks(layer)
        n, k, like = layer.out_features, layer.in_features, layer.weight
        layer.weight = _param(n, k, dtype=FP8, like=like)
        blocks = _param(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32, like=like)
        layer.register_parameter(self.scale_name, blocks)

    def slot(self, layer: Linear, kind: str, index: int | None, plan: LoadPlan) -> Slot | None:
        start, end, shard = plan
        if kind == "weight":
            return Slot(start, end, shard, fill=partial(copy_fp8, layer.weight))
        if kind != self.scale_name:
            return Slot(*plan)
        if shard.dim is not None:
            shard = Shard(
                shard.dim, shard.start // BLOCK, -(-shard.end // BLOCK), -(-shard.full // BLOCK)
            )
        return Slot(start // BLOCK, -(-end // BLOCK), shard)

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        w = torch.empty(layer.weight.shape, device=layer.weight.device)
        q, scale = quantize_blocks(w.normal_(0.0, 0.02, generator=gen))
        layer.weight.copy_(q)
        self.scale(layer).copy_(scale)

    def dequantized(self, layer: Linear) -> torch.Tensor:
        return dequantize(layer.weight, self.scale(layer), BLOCK)

    def dense(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not x.is_cuda:
            return F.linear(x, self.dequantized(layer).to(x.dtype), bias)
        batch = _decode_batch(layer, x, self.scale(layer), bias, blocks=True)
        if batch is not None:
            return batch
        from kernels.fp8_act_quant import quantize_act
        from kernels.fp8_block_gemm import fp8_block_gemm

        xq, xs = quantize_act(_rows_x(x), group=BLOCK)
        out = fp8_block_gemm(xq, xs, layer.weight, self.scale(layer), out_dtype=x.dtype)
        out = out.view(*x.shape[:-1], layer.out_features)
        return out if bias is None else out + bias

    def gemv_candidates(self, layer: Linear) -> tuple[GemvConfig, ...]:
        return FP8_CANDIDATES

    def gemv(self, layer: Linear, x: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        from kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(
            x, layer.weight, self.scale(layer), block_scales=True,
            block_n=cfg.block_n, block_k=max(cfg.block_k, BLOCK),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, packed=cfg.packed,
        )  # fmt: skip


def _check_whole_blocks(layer: Linear) -> None:
    """Refuse stacked parts or tensor-parallel slices that start inside a 128x128 block: each
    block has one scale, so a slice of one would need another rank's (or part's) scale."""
    cuts: list[str] = []
    at = 0
    for full, start, rows in getattr(layer, "parts", []):  # ColumnParallelLinear's
        if at % BLOCK or start % BLOCK or (rows % BLOCK and start + rows != full):
            cuts.append(f"rows [{start}, {start + rows}) of {full} placed at row {at}")
        at += rows
    full_in = getattr(layer, "full_in", None)  # RowParallelLinear's
    tp = getattr(layer, "tp", None)
    if full_in is not None and tp is not None:
        start, cols = tp.rank * layer.in_features, layer.in_features
        if start % BLOCK or (cols % BLOCK and start + cols != full_in):
            cuts.append(f"columns [{start}, {start + cols}) of {full_in}")
    if cuts:
        tp_size = tp.size if tp is not None else 1
        raise UnsupportedQuantizationError(
            f"fp8 128x128 block scales: a projection's {'; '.join(cuts)} would cut a "
            f"128-wide block (--tp-size {tp_size}); fused parts and tensor-parallel slices "
            "must be multiples of 128: choose a --tp-size that keeps them so"
        )
