"""Apply a packed token bitmask to logits in place: disallowed tokens get -inf.

xgrammar's layout: bitmask [rows, cdiv(vocab, 32)] int32, bit j % 32 of word j // 32 set
means token j is allowed. `indices` names the rows to mask (each is a row of both logits and
bitmask, as in xgrammar's apply_token_bitmask_inplace); other rows are left alone. Tokens past
the bitmask's 32 * words (a padded vocabulary) are left alone too.

Grid: (num_indices, cdiv(vocab, BLOCK)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor, next_pow2

_BLOCK = 4096


@triton.jit
def _bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    stride_logits,
    stride_bitmask,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.load(indices_ptr + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    words = tl.load(bitmask_ptr + row * stride_bitmask + offs // 32, mask=mask, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_logits + offs
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty), mask & ~allowed)


def apply_token_bitmask(
    *, logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """logits [bs, vocab] float (any row stride); bitmask [bs, words] int32; indices [k] ints,
    each < bs (default: every row). Writes -inf over the disallowed tokens of those rows."""
    op = "apply_token_bitmask"
    check_tensor(op, "logits", logits, shape=(None, None), dims="[bs, vocab]", dtypes=FLOAT_DTYPES)
    check_device(op, logits)
    bs, vocab = logits.shape
    dev = logits.device
    check_tensor(
        op,
        "bitmask",
        bitmask,
        shape=(bs, None),
        dims="[bs, words]",
        dtypes=(torch.int32,),
        device=dev,
    )
    if indices is None:
        indices = torch.arange(bs, dtype=torch.int32, device=dev)
    check_tensor(op, "indices", indices, shape=(None,), dims="[k]", dtypes=INDEX_DTYPES, device=dev)
    covered = min(vocab, 32 * bitmask.shape[1])
    if indices.shape[0] == 0 or covered == 0:
        return
    block = min(_BLOCK, next_pow2(covered))
    _bitmask_kernel[(indices.shape[0], triton.cdiv(covered, block))](
        logits,
        bitmask,
        indices.contiguous(),
        logits.stride(0),
        bitmask.stride(0),
        covered,
        BLOCK=block,
        num_warps=4,
    )


def apply_token_bitmask_ref(
    *, logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """The torch twin of `apply_token_bitmask` (in place)."""
    rows = torch.arange(logits.shape[0], device=logits.device) if indices is None else indices
    covered = min(logits.shape[1], 32 * bitmask.shape[1])
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[rows][:, :, None] >> bits) & 1).bool().flatten(1)[:, :covered]
    block = logits[rows, :covered]
    logits[rows, :covered] = block.masked_fill(~allowed, float("-inf"))
