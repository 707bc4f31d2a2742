"""GGUF projections kept as their file's blocks (Q8_0, Q4_K, Q6_K; layouts in
kernels/gguf_blocks.py): weight is uint8 [out, in / elems * bytes], one row of blocks per
output feature, as the file stores it.

On CUDA every product reads the blocks (kernels/gguf_matmul: the GEMV for decode's few
rows, slices expanded for cuBLAS past that), and
choose_gemv may pick a GEMV launch configuration per row count. Q4_K projections of a 16-bit
model on a GPU with the tensor cores' MMA (compute capability 8.0 and newer) are converted at
load instead (`finish`) into the int4 MMA's layout (kernels/gguf_q4k_mma.py: the nibbles
shuffled for groups of 32 columns, each sub-block's scale and min in the model's type), which
kernels/w4a16_mma.py multiplies for decode batches of 1 to 64 rows and expands for cuBLAS past
that; only that copy is kept. Elsewhere (the CPU) the
weight is dequantised per call (bit-exact with the gguf package), so a CPU model computes
what the dequantised-at-load model does.

Rows of blocks are rows of weights, so stacked parts and column-parallel slices are row
ranges as for a float weight; a row-parallel slice is a range of whole blocks, which `refuses`
checks (the rest of the layer is then loaded dequantised).
"""

from __future__ import annotations

import os
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gguf_blocks import LAYOUTS, dequantize_ref, random_blocks, row_bytes
from services.executor.distributed.shard import LoadPlan, Shard
from services.executor.errors import ModelLoadError
from services.executor.models.linear import GemvConfig, Linear
from services.executor.quant.base import LinearMethod, Slot, use_kernels
from services.executor.quant.int4_linear import MMA_CANDIDATES, MMA_TILE_ROWS


def _copy_blocks(param: torch.Tensor, start: int, end: int, part: torch.Tensor) -> None:
    """The file's blocks, refused in any other dtype (a cast would turn bytes into numbers)."""
    if part.dtype != torch.uint8:
        raise ModelLoadError(f"is {part.dtype}; GGUF blocks are read as uint8 bytes")
    param[start:end].copy_(part)


def dummy_blocks(
    n: int, k: int, qtype: str, gen: torch.Generator, std: float = 0.02
) -> torch.Tensor:
    """Random valid blocks [n, row bytes] (CPU) whose weights have about `std`: random_blocks
    with its fp16 scales shrunk (every weight is linear in them)."""
    lay = LAYOUTS[qtype]
    blocks = random_blocks(n, k, qtype, gen).reshape(n, -1, lay.bytes)
    sample = dequantize_ref(blocks[:64].reshape(min(n, 64), -1), qtype)
    shrink = std / max(float(sample.std()), 1e-12)
    fields = {"Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype]
    for at in fields:
        d = blocks[..., at : at + 2].contiguous().view(torch.float16)
        blocks[..., at : at + 2] = (d.float() * shrink).half().view(torch.uint8)
    return blocks.reshape(n, -1)


# Launch configurations choose_gemv times, per type (kernels/gguf_gemv.py): (rows a program,
# warps). block_k counts weights, and a step spans every thread of a type's warps once at
# block_k = WARP_SPAN * warps: Q4_K puts 8 threads on a 144-byte super-block, Q6_K 16, Q8_0 4
# on a 32-weight block, about 570 bytes of a row a warp for each. Each thread keeps all the
# program's rows (each column of x is loaded once for them): 16 rows where a projection has
# them for a few waves of programs, 8 and 4 for the narrower (MoE experts, MLA) and for more
# rows of x (fewer registers); two warps for short rows, eight for long ones.
WARP_SPAN = {"Q4_K": 1024, "Q6_K": 512, "Q8_0": 256}
GGUF_SHAPES = ((16, 4), (8, 4), (4, 4), (16, 2), (8, 2), (8, 8))
GGUF_CANDIDATES = {
    qtype: tuple(GemvConfig(rows, span * warps, warps, 1) for rows, warps in GGUF_SHAPES)
    for qtype, span in WARP_SPAN.items()
}


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class PackedQ4k(nn.Module):
    """A Q4_K projection converted for kernels/w4a16_mma (kernels/gguf_q4k_mma.q4k_to_mma)."""

    def __init__(self, qmma: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        super().__init__()
        self.qmma = _frozen(qmma)  # int32 [N / 16, K / 64, 32, 4]
        self.scales = _frozen(scales)  # [N, K / 32], the model's 16-bit type
        self.mins = _frozen(mins)  # [N, K / 32]

    def weight(self) -> torch.Tensor:
        """fp32 [N, K]: scale * q - min, for references and the CPU path."""
        from kernels.w4a16 import unpack_int4
        from kernels.w4a16_mma import G32, unshuffle_w4

        q = unpack_int4(unshuffle_w4(self.qmma, group_size=G32)).float()
        scales = self.scales.float().repeat_interleave(G32, dim=1)
        return scales * q - self.mins.float().repeat_interleave(G32, dim=1)


def _q4k(layer: Linear) -> PackedQ4k | None:
    packed = getattr(layer, "q4k", None)
    return packed if isinstance(packed, PackedQ4k) else None


def q4k_mma_layout(layer: Linear, act_dtype: torch.dtype) -> bool:
    """Whether a Q4_K projection is converted for the MMA: its blocks on a GPU with the MMA,
    16-bit activations, and shapes the MMA takes (N a multiple of 16, K of 64); unless
    RADIXSERVE_Q4K_MMA=0, which keeps the blocks and their kernels (to compare the two in one
    tree, or to rule the conversion out)."""
    w = layer.weight
    if os.environ.get("RADIXSERVE_Q4K_MMA", "1") == "0":
        return False
    if not w.is_cuda or act_dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(w.device)[0] < 8:
        return False
    return layer.out_features % 16 == 0 and layer.in_features % 64 == 0


class GgufMethod(LinearMethod):
    """weight: uint8 blocks of one GGUF type `qtype`, [out_features, row bytes]; or, for Q4_K
    on a GPU (`q4k_mma_layout`), `layer.q4k` (PackedQ4k) in their place and weight a [N, K /
    8] int32 view of its words."""

    def __init__(self, qtype: str) -> None:
        self.qtype, self.lay = qtype, LAYOUTS[qtype]
        self.name = f"gguf-{qtype}"
        self.act_dtype = torch.float32

    def refuses(self, layer: Linear) -> str | None:
        if layer.in_features % self.lay.elems:
            cut = "a tensor-parallel slice of" if hasattr(layer, "full_in") else ""
            return (
                f"{cut} {layer.in_features} input columns are not whole {self.qtype} blocks "
                f"of {self.lay.elems}"
            ).lstrip()
        return None

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        self.act_dtype = layer.weight.dtype  # the model's (every layer's): the MMA's is 16-bit
        layer.weight = nn.Parameter(
            torch.empty(n, row_bytes(self.qtype, k), dtype=torch.uint8, device=layer.weight.device),
            requires_grad=False,
        )

    def slot(self, layer: Linear, kind: str, index: int | None, plan: LoadPlan) -> Slot | None:
        start, end, shard = plan
        if kind != "weight":
            return Slot(*plan)  # biases stay float
        if shard.dim == 1:  # a row-parallel slice: its columns as bytes (whole blocks, refuses)
            e, b = self.lay.elems, self.lay.bytes
            shard = Shard(1, shard.start // e * b, shard.end // e * b, shard.full // e * b)
        return Slot(start, end, shard, fill=partial(_copy_blocks, layer.weight))

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        # random_blocks draws on the CPU: a CPU generator seeded from the model's
        seed = int(torch.randint(1 << 62, (1,), generator=gen, device=gen.device))
        blocks = dummy_blocks(
            layer.out_features, layer.in_features, self.qtype, torch.Generator().manual_seed(seed)
        )
        layer.weight.copy_(blocks)

    def finish(self, layer: Linear) -> None:
        if self.qtype != "Q4_K" or _q4k(layer) is not None:
            return
        if not q4k_mma_layout(layer, self.act_dtype):
            return
        from kernels.gguf_q4k_mma import q4k_to_mma

        # Scales and mins in the model's 16-bit type: the MMA takes them inside its A fragments.
        # In fp16 only below 64 (-1024 s must stay finite there); else fp32, which the MMA folds
        # (exact, slower): a load-time check, one host sync a projection.
        qmma, scales, mins = q4k_to_mma(layer.weight, layer.in_features, dtype=torch.float32)
        keep = self.act_dtype
        if keep == torch.float16 and float(scales.abs().max()) >= 64.0:
            keep = torch.float32
        packed = PackedQ4k(qmma, scales.to(keep), mins.to(keep))
        del layer.weight  # the blocks: only the converted copy stays
        layer.q4k = packed
        layer.weight = packed.qmma.view(layer.out_features, -1)

    def dequantized(self, layer: Linear) -> torch.Tensor:
        packed = _q4k(layer)
        if packed is not None:
            return packed.weight()
        return dequantize_ref(layer.weight, self.qtype)

    def dense(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not use_kernels(x):
            return F.linear(x, self.dequantized(layer).to(x.dtype), bias)
        rows = x.reshape(-1, x.shape[-1])
        packed = _q4k(layer)
        if packed is not None:
            out = self._mma(packed, rows)
        else:
            from kernels.gguf_matmul import gguf_matmul

            out = gguf_matmul(rows, layer.weight, qtype=self.qtype)
        out = out.view(*x.shape[:-1], layer.out_features)
        return out if bias is None else out + bias

    @staticmethod
    def _mma(packed: PackedQ4k, x: torch.Tensor, cfg: GemvConfig | None = None) -> torch.Tensor:
        from kernels.w4a16_matmul import w4a16_mma_matmul
        from kernels.w4a16_mma import G32

        return w4a16_mma_matmul(
            x, packed.qmma, packed.scales, None, group_size=G32, mins=packed.mins,
            split=None if cfg is None else cfg.num_warps,
            ahead=None if cfg is None else cfg.num_stages,
        )  # fmt: skip

    def gemv_candidates(self, layer: Linear) -> tuple[GemvConfig, ...]:
        return MMA_CANDIDATES if _q4k(layer) is not None else GGUF_CANDIDATES[self.qtype]

    def dense_ahead_rows(self, layer: Linear) -> tuple[int, ...]:
        return MMA_TILE_ROWS if _q4k(layer) is not None else ()

    def gemv(self, layer: Linear, x: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        packed = _q4k(layer)
        if cfg.mma:
            assert packed is not None, "an MMA launch for a layer kept as blocks"
            return self._mma(packed, x, cfg)
        assert packed is None, "a block GEMV launch for a layer converted for the MMA"
        from kernels.gguf_gemv import gguf_gemv

        return gguf_gemv(
            x, layer.weight, qtype=self.qtype,
            block_n=cfg.block_n, block_k=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
