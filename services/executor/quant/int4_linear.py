"""int4 projections with 16-bit activations (w4a16), loaded from AWQ and GPTQ checkpoints.

A projection is created with the checkpoint's own tensors (int4_layouts.py describes both
layouts): their output features are columns, so stacked parts (q/k/v, gate/up) and column-
parallel slices are placed along dim 1, and a row-parallel rank reads its rows of K (qweight,
g_idx) with every group's scales and zero points. After loading, `finish` converts them into
the kernels' layout (kernels/w4a16.py), held by a `PackedInt4` under the layer's `int4`, and
frees the checkpoint's. The layer's `weight` is then the packed words [N, K / 8], so what
reads a Linear's weight (choose_gemv's device and shape, the benchmark's byte count) sees
what the kernels read.

On CUDA every product goes through kernels/w4a16_matmul. A bf16/fp16 model keeps the words
shuffled for the tensor cores' MMA (`PackedInt4.qmma`, in place of the plain words): the MMA
for decode's 1 to 64 rows, past that (prefill) the weight expanded a slice at a time for
cuBLAS. Otherwise (fp32, shapes the MMA does not take) the GEMV for the few rows of decode,
the tensor-core GEMM up to its GEMM_MAX_M rows, the expansion past that. Elsewhere (the CPU)
the weight is dequantized and multiplied in torch.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels.w4a16 import PACK, pack_int4
from kernels.w4a16_mma import mma_shape_fits, shuffle_w4, unshuffle_w4
from services.executor.distributed.shard import WHOLE, LoadPlan, Shard
from services.executor.errors import ModelLoadError, UnsupportedQuantizationError
from services.executor.models.linear import GemvConfig, Linear
from services.executor.quant.base import LinearMethod, Slot, use_kernels
from services.executor.quant.int4_layouts import (
    KERNEL_GROUP,
    Int4Config,
    Int4Weight,
    awq_to_int4,
    gptq_to_int4,
)

# checkpoint tensor -> (packing of its K rows: None where its rows are groups, read whole
# by every rank; packing of its N columns: None where it has none), the format's layout
_TENSORS: dict[str, dict[str, tuple[int | None, int | None]]] = {
    "awq": {"qweight": (1, PACK), "qzeros": (None, PACK), "scales": (None, 1)},
    "gptq": {"qweight": (PACK, 1), "qzeros": (None, PACK), "scales": (None, 1), "g_idx": (1, None)},
}
# scales are float16 in both formats' writers (AutoAWQ, AutoGPTQ, GPTQModel)
_DTYPES = {"qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16}


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class PackedInt4(nn.Module):
    """One projection's weight in the kernels' layout (int4_layouts.Int4Weight, registered):
    the plain words (`qweight`), or on a GPU that runs kernels/w4a16_mma for it (`mma`) the
    same words shuffled for the MMA (`qmma`, kernels/w4a16_mma.shuffle_w4) in their place."""

    def __init__(self, w: Int4Weight, *, mma: bool = False) -> None:
        super().__init__()
        # int32 [N, K / 8] or int32 [N / 16, K / 64, 32, 4]: one of the two
        self.qweight = None if mma else _frozen(w.qweight)
        self.qmma = _frozen(shuffle_w4(w.qweight, group_size=w.group_size)) if mma else None
        self.scales = _frozen(w.scales)  # [N, G]
        self.zeros = _frozen(w.zeros)  # uint8 [N, G]
        self.perm = None if w.perm is None else _frozen(w.perm)  # int32 [K] (act-order)
        self.group_size, self.in_features = w.group_size, w.in_features

    def words(self) -> torch.Tensor:
        """The words as [N, K / 8] int32, whichever layout holds them (the shuffled words
        viewed so, for what reads a Linear's weight: its device, shape and bytes)."""
        if self.qweight is not None:
            return self.qweight
        assert self.qmma is not None
        return self.qmma.view(self.scales.shape[0], -1)

    def weight(self) -> Int4Weight:
        """The weight in the plain layout (the shuffled words unshuffled: for the torch twin)."""
        if self.qweight is not None:
            plain: torch.Tensor = self.qweight
        else:
            assert self.qmma is not None
            plain = unshuffle_w4(self.qmma, group_size=self.group_size)
        return Int4Weight(
            qweight=plain,
            scales=self.scales,
            zeros=self.zeros,
            group_size=self.group_size,
            perm=self.perm,
            in_features=self.in_features,
        )


def _packed(layer: Linear) -> PackedInt4:
    packed = layer.int4
    assert isinstance(packed, PackedInt4), "an int4 projection used before finish_loading"
    return packed


def _tensor(layer: Linear, name: str) -> torch.Tensor:
    t = getattr(layer, name)
    assert isinstance(t, torch.Tensor), name
    return t


def _k_range(layer: Linear) -> tuple[int, int]:
    """(the first input column this rank holds, the checkpoint's input columns): a
    row-parallel rank's share of K, as its load plan reads it."""
    _, _, shard = layer.load_plan("qweight", None)
    return (shard.start, shard.full) if shard.dim == 1 else (0, layer.in_features)


def _copy(param: torch.Tensor, dim: int, start: int, end: int, t: torch.Tensor) -> None:
    """A checkpoint tensor's part into [start, end) of `dim`. Packed words come as int32 only
    (another width is another packing), g_idx as any integers, scales as any float."""
    if param.dtype.is_floating_point:
        ok = t.dtype.is_floating_point
    else:
        ok = t.dtype == param.dtype if param.dim() == 2 else not t.dtype.is_floating_point
    if not ok:
        raise ModelLoadError(f"is {t.dtype}; an int4 checkpoint stores it as {param.dtype}")
    param.narrow(dim, start, end - start).copy_(t)


# The GEMV's launches: each thread reads 4 consecutive words of a row a step (one 16-byte
# load), so a step's columns are at least 32 x 32 x warps (fewer would split a thread's words
# across threads and add shuffles); 2 to 8 rows a program, 1 to 4 warps. The start-up timing
# picks one per shape and row count.
INT4_CANDIDATES = (
    GemvConfig(8, 2048, 2, 3),
    GemvConfig(8, 4096, 4, 3),
    GemvConfig(8, 1024, 1, 3),
    GemvConfig(4, 2048, 2, 3),
    GemvConfig(4, 4096, 4, 3),
    GemvConfig(4, 1024, 1, 3),
    GemvConfig(2, 2048, 2, 3),
)
# kernels/w4a16_mma.py where the layer has the shuffled words: a tile of 16 weight rows, 64
# columns a chunk, num_warps warps splitting K, num_stages chunks of words loaded ahead (at
# one to four rows of x on an H200, the best launches of Llama-3.1-8B's projections:
# loadtest/results/gpu_w4a16_mma_h200_run5.json)
# A decode batch's rows for each specialisation of the MMA that the CUDA graphs' batch sizes
# (services/executor/cuda_graph.capture_sizes) reach past the start-up timing's 1 to 4: 2, 4
# and 8 tiles of 8 rows of x, each with its own launch defaults, and Triton's specialisation
# of M on being a multiple of 16 (16, 32, 48, 64 against 24, 40, 56). One to 8 rows are one
# tile, compiled by the timing.
MMA_TILE_ROWS = (16, 24, 32, 40, 64)
MMA_CANDIDATES = (
    GemvConfig(16, 64, 4, 2, mma=True),
    GemvConfig(16, 64, 8, 2, mma=True),
    GemvConfig(16, 64, 8, 4, mma=True),
)


class Int4Method(LinearMethod):
    """AWQ (gemm) or GPTQ (v1, gptq_v2; act-order) int4 weights, as `layout` says."""

    name = "w4a16"

    def __init__(self, layout: Int4Config) -> None:
        self.layout = layout
        self.tensors = _TENSORS[layout.method]
        self.act_dtype = torch.float32

    def create_weights(self, layer: Linear) -> None:
        _check_packing(layer)
        n, k = layer.out_features, layer.in_features
        _, full_k = _k_range(layer)
        g = self.layout.group_size
        groups = 1 if g < 0 else -(-full_k // g)
        parts = len(getattr(layer, "parts", [()]))  # ColumnParallelLinear's stacked parts
        shapes = {
            "qweight": (k, n // PACK) if self.layout.method == "awq" else (k // PACK, n),
            "qzeros": (groups, n // PACK),
            "scales": (groups, n),
            # each stacked part's, side by side: finish checks they agree (one act-order)
            "g_idx": (parts * k,),
        }
        device = layer.weight.device
        self.act_dtype = layer.weight.dtype  # the model's (every layer's): the MMA's is 16-bit
        del layer.weight
        for name in self.tensors:
            t = torch.empty(shapes[name], dtype=_DTYPES.get(name, torch.int32), device=device)
            layer.register_parameter(name, _frozen(t))

    def slot(self, layer: Linear, kind: str, index: int | None, plan: LoadPlan) -> Slot | None:
        if kind not in self.tensors:
            return Slot(*plan)  # the bias
        k_pack, n_pack = self.tensors[kind]
        param = _tensor(layer, kind)
        start, end, shard = plan
        if shard.dim == 1:  # row-parallel: this rank's rows of K, every group
            if k_pack is not None:
                shard = Shard(0, shard.start // k_pack, shard.end // k_pack, shard.full // k_pack)
            else:
                shard = WHOLE
            return Slot(0, param.shape[0], shard, fill=partial(_copy, param, 0))
        if n_pack is None:  # g_idx: each stacked part's own, side by side (checked at finish)
            at = (index or 0) * layer.in_features
            return Slot(at, at + layer.in_features, WHOLE, fill=partial(_copy, param, 0))
        # output rows [start, end) of the weight are columns here, as is the part read
        if shard.dim == 0:
            shard = Shard(1, shard.start // n_pack, shard.end // n_pack, shard.full // n_pack)
        fill = partial(_copy, param, 1)
        return Slot(start // n_pack, end // n_pack, shard, fill=fill, dim=1)

    def finish(self, layer: Linear) -> None:
        if not hasattr(layer, "qweight"):
            return  # converted already (dummy weights)
        t = {name: _tensor(layer, name) for name in self.tensors}
        k_start, _ = _k_range(layer)
        g = self.layout.group_size
        if self.layout.method == "awq":
            w = awq_to_int4(t["qweight"], t["qzeros"], t["scales"], group_size=g, k_start=k_start)
        else:
            g_idx = t["g_idx"].view(-1, layer.in_features)
            if not bool((g_idx == g_idx[0]).all()):
                raise UnsupportedQuantizationError(
                    "gptq: the parts of a fused projection (q/k/v or gate/up) have different "
                    "g_idx (act-order); they read one input and must share its order"
                )
            w = gptq_to_int4(
                t["qweight"], t["qzeros"], t["scales"], g_idx[0],
                group_size=g, zero_offset=self.layout.zero_offset, k_start=k_start,
            )  # fmt: skip
        _install(layer, w, list(self.tensors), self.act_dtype)

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        """Random nibbles 1..15 around a zero point of 8, scaled to a std of 0.02, in the
        kernels' layout directly (quantizing a random float weight is slow at 8B shapes);
        groups as the checkpoint's; with act-order (desc_act) a random order of x's columns,
        as a checkpoint's g_idx gives one (timing what act-order costs needs its perm)."""
        n, k, device = layer.out_features, layer.in_features, _tensor(layer, "qweight").device
        group = self.layout.group_size if self.layout.group_size > 0 else KERNEL_GROUP
        q = torch.randint(1, 16, (n, k), generator=gen, device=device, dtype=torch.uint8)
        groups = -(-k // group)
        perm = None
        if self.layout.desc_act:
            perm = torch.randperm(k, generator=gen, device=device).to(torch.int32)
        w = Int4Weight(
            qweight=pack_int4(q),
            scales=torch.full((n, groups), 0.02 / 4.32, dtype=torch.float16, device=device),
            zeros=torch.full((n, groups), 8, dtype=torch.uint8, device=device),
            group_size=group,
            perm=perm,
            in_features=k,
        )
        _install(layer, w, list(self.tensors), self.act_dtype)

    def dequantized(self, layer: Linear) -> torch.Tensor:
        return _packed(layer).weight().dequantize()

    def dense(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not use_kernels(x):
            return F.linear(x, self.dequantized(layer).to(x.dtype), bias)
        from kernels.w4a16_matmul import w4a16_matmul, w4a16_mma_matmul

        p = _packed(layer)
        rows = x.reshape(-1, x.shape[-1])
        if p.qmma is not None:
            out = w4a16_mma_matmul(
                rows, p.qmma, p.scales, p.zeros, group_size=p.group_size, perm=p.perm
            )
        else:
            assert p.qweight is not None
            out = w4a16_matmul(
                rows, p.qweight, p.scales, p.zeros, group_size=p.group_size, perm=p.perm
            )
        out = out.view(*x.shape[:-1], layer.out_features)
        return out if bias is None else out + bias

    def gemv_candidates(self, layer: Linear) -> tuple[GemvConfig, ...]:
        return MMA_CANDIDATES if _packed(layer).qmma is not None else INT4_CANDIDATES

    def dense_ahead_rows(self, layer: Linear) -> tuple[int, ...]:
        return MMA_TILE_ROWS if _packed(layer).qmma is not None else ()

    def gemv(self, layer: Linear, x: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        from kernels.w4a16_gemv import w4a16_gemv
        from kernels.w4a16_matmul import w4a16_mma_matmul

        p = _packed(layer)
        if cfg.mma:
            assert p.qmma is not None, "an MMA launch for a layer without the shuffled words"
            return w4a16_mma_matmul(
                x, p.qmma, p.scales, p.zeros, group_size=p.group_size, perm=p.perm,
                split=cfg.num_warps, ahead=cfg.num_stages,
            )  # fmt: skip
        assert p.qweight is not None, "a GEMV launch for a layer whose words are shuffled"
        return w4a16_gemv(
            x, p.qweight, p.scales, p.zeros, group_size=p.group_size, perm=p.perm,
            block_n=cfg.block_n, block_k=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


def mma_layout(w: Int4Weight, act_dtype: torch.dtype) -> bool:
    """Whether the layer keeps its words shuffled for kernels/w4a16_mma (in place of the plain
    layout): on a GPU with the MMA (compute capability 8.0 and newer), for 16-bit activations
    and the shapes it takes."""
    n, words = w.qweight.shape
    if not w.qweight.is_cuda or act_dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(w.qweight.device)[0] < 8:
        return False
    return mma_shape_fits(n, words * PACK, w.group_size)  # groups of 32: their own layout


def _install(
    layer: Linear, w: Int4Weight, checkpoint_tensors: list[str], act_dtype: torch.dtype
) -> None:
    """The kernels' layout in place of the checkpoint's tensors."""
    for name in checkpoint_tensors:
        delattr(layer, name)
    packed = PackedInt4(w, mma=mma_layout(w, act_dtype))
    layer.int4 = packed
    layer.weight = packed.words()


def _check_packing(layer: Linear) -> None:
    """Refuse stacked parts or tensor-parallel slices that start inside a packed int32 word:
    8 output features (AWQ, and both formats' qzeros) or 8 input channels (GPTQ) share one."""
    cuts: list[str] = []
    at = 0
    n = layer.out_features
    for full, start, rows in getattr(layer, "parts", [(n, 0, n)]):
        if at % PACK or start % PACK or rows % PACK or full % PACK:
            cuts.append(f"output rows [{start}, {start + rows}) of {full} placed at row {at}")
        at += rows
    k_start, full_k = _k_range(layer)
    if k_start % PACK or layer.in_features % PACK or full_k % PACK:
        cuts.append(f"input columns [{k_start}, {k_start + layer.in_features}) of {full_k}")
    if cuts:
        raise UnsupportedQuantizationError(
            f"int4 weights pack 8 values in a word: a projection's {'; '.join(cuts)} would cut "
            "one; fused parts and tensor-parallel slices must be multiples of 8"
        )
