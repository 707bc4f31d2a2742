"""MoE align: the (token, slot) pairs of a top-k routing grouped by expert, each expert's run
padded to a multiple of BLOCK_M, for kernels/fused_moe's grouped GEMMs.

A decode step pays this in every layer, and the torch twin below takes about fifteen small
kernels. Small batches (pairs x experts up to _ONE_PROGRAM_CELLS) take one launch: one program
holds the [pairs, experts] one-hot matrix, whose column sums are the counts and whose running
column sums give each pair its place. Larger ones take three launches and a memset:

1. count (grid over pairs): rank[p] = atomic_add(counts[expert of p], 1): the pair's place in
   its expert's run (in the order the atomics land: rows of one expert are independent, so
   the order changes no result).
2. offsets (one program): padded runs, their starts (exclusive cumsum), the padded total, the
   expert of every BLOCK_M block (-1 past the total), sorted_ids filled with padding.
3. scatter (grid over pairs): sorted_ids[start[expert] + rank] = p.

Output shapes depend only on (pairs, experts, BLOCK_M) and nothing is read back to the host,
so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import INDEX_DTYPES, check_device, check_tensor, next_pow2
from kernels.pdl import pdl_launch, pdl_prologue

_PAIRS_BLOCK = 256
_ONE_PROGRAM_CELLS = 16384  # pairs x experts (powers of two) the one-program path holds
_CHUNK = 64  # blocks per step of the offsets program
_FILL = 1024  # sorted_ids entries per step of the offsets program


@triton.jit
def _block_experts_and_padding(
    ends,
    e_mask,
    expert_ids_ptr,
    sorted_ids_ptr,
    n,
    num_experts,
    max_blocks,
    max_padded,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """Both align paths' tail: each block's expert from the runs' padded ends (-1 past the
    last run), and every sorted slot set to padding (n) before the pairs are placed."""
    for b0 in range(0, max_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        at = blocks * BLOCK_M
        # a block's expert: how many runs end at or before its first row
        before = (ends[None, :] <= at[:, None]) & e_mask[None, :]
        expert = tl.sum(before.to(tl.int32), 1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < max_blocks)
    for s0 in range(0, max_padded, FILL):
        offs = s0 + tl.arange(0, FILL)
        padding = tl.zeros([FILL], dtype=tl.int32) + n
        tl.store(sorted_ids_ptr + offs, padding, mask=offs < max_padded)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=mask)
    tl.store(rank_ptr + offs, rank, mask=mask)


@triton.jit
def _offsets_kernel(
    counts_ptr,
    starts_ptr,
    expert_ids_ptr,
    total_ptr,
    sorted_ids_ptr,
    num_experts,
    max_blocks,
    max_padded,
    n,
    BLOCK_M: tl.constexpr,
    E_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    e = tl.arange(0, E_BLOCK)
    e_mask = e < num_experts
    counts = tl.load(counts_ptr + e, mask=e_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + e, ends - padded, mask=e_mask)
    tl.store(total_ptr, tl.sum(padded, 0))
    _block_experts_and_padding(
        ends, e_mask, expert_ids_ptr, sorted_ids_ptr, n, num_experts, max_blocks, max_padded,
        BLOCK_M, CHUNK, FILL,
    )  # fmt: skip


@triton.jit
def _scatter_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ids_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    rank = tl.load(rank_ptr + offs, mask=mask, other=0)
    start = tl.load(starts_ptr + expert, mask=mask, other=0)
    tl.store(sorted_ids_ptr + start + rank, offs.to(tl.int32), mask=mask)


@triton.jit
def _align_one_program_kernel(
    ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    n,
    num_experts,
    max_blocks,
    max_padded,
    BLOCK_M: tl.constexpr,
    N_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    p = tl.arange(0, N_BLOCK)
    p_mask = p < n
    e = tl.arange(0, E_BLOCK)
    e_mask = e < num_experts
    expert_of = tl.load(ids_ptr + p, mask=p_mask, other=-1)
    onehot = (expert_of[:, None] == e[None, :]).to(tl.int32)  # [pairs, experts]
    counts = tl.sum(onehot, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(total_ptr, tl.sum(padded, 0))
    _block_experts_and_padding(
        ends, e_mask, expert_ids_ptr, sorted_ids_ptr, n, num_experts, max_blocks, max_padded,
        BLOCK_M, CHUNK, FILL,
    )  # fmt: skip
    tl.debug_barrier()  # every thread's padding is written before any pair lands on it
    rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1  # earlier pairs of the same expert
    start = tl.sum(onehot * starts[None, :], 1)
    tl.store(sorted_ids_ptr + start + rank, p.to(tl.int32), mask=p_mask)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the padded runs can take: every expert with pairs may waste block_m - 1,
    and at most min(experts, pairs) experts have any. A decode step's few pairs thus get a
    few blocks (Qwen3-30B-A3B at batch 1: 8, not 121), and fused_moe launches that many."""
    used = min(num_experts, num_pairs)
    return triton.cdiv(num_pairs + used * (block_m - 1), block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, one_program: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the pairs of topk_ids [tokens, top_k] (pair = token * top_k + slot) by expert.

    Returns (sorted_ids [max_padded] int32: each expert's pairs, then padding entries
    tokens * top_k up to a multiple of block_m; expert_ids [max_padded // block_m] int32:
    the expert of each block, -1 past the padded total; num_post_padded [1] int32). Within
    an expert's run the order of its pairs is unspecified. one_program: force the one-launch
    path (True) or the three-launch one (False); None chooses by size.
    """
    op = "moe_align"
    check_tensor(
        op, "topk_ids", topk_ids, shape=(None, None), dims="[tokens, top_k]", dtypes=INDEX_DTYPES
    )
    check_device(op, topk_ids)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"{op}: block_m must be a power of two, got {block_m}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    max_padded = max_padded_pairs(n, num_experts, block_m)
    max_blocks = max_padded // block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    n_block, e_block = max(16, next_pow2(n)), next_pow2(num_experts)
    if one_program is None:
        one_program = n_block * e_block <= _ONE_PROGRAM_CELLS
    if one_program:
        _align_one_program_kernel[(1,)](
            flat,
            sorted_ids,
            expert_ids,
            total,
            n,
            num_experts,
            max_blocks,
            max_padded,
            BLOCK_M=block_m,
            N_BLOCK=n_block,
            E_BLOCK=e_block,
            CHUNK=_CHUNK,
            FILL=_FILL,
            num_warps=4,
            **pdl_launch(flat.device),
        )
        return sorted_ids, expert_ids, total
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    grid = (max(1, triton.cdiv(n, _PAIRS_BLOCK)),)
    _count_kernel[grid](flat, counts, rank, n, BLOCK=_PAIRS_BLOCK)
    _offsets_kernel[(1,)](
        counts,
        starts,
        expert_ids,
        total,
        sorted_ids,
        num_experts,
        max_blocks,
        max_padded,
        n,
        BLOCK_M=block_m,
        E_BLOCK=e_block,
        CHUNK=_CHUNK,
        FILL=_FILL,
    )
    _scatter_kernel[grid](flat, rank, starts, sorted_ids, n, BLOCK=_PAIRS_BLOCK)
    return sorted_ids, expert_ids, total


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin of `moe_align` (each expert's pairs in pair order): no host sync and
    fixed shapes as well, in about fifteen kernels."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    max_padded = max_padded_pairs(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order
    expert_of = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)
