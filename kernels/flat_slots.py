"""Every request's KV slots, one after another: the page table of pages of one token.

FlashInfer reads a paged cache through `kv_indptr` ([bs + 1]: where each request's pages
start) and `kv_indices` (the pages). With pages of one slot, a request's pages are its row
of the request table, `req_to_token[row, :seq_len]`; this gathers those rows into one flat
int32 array, on the device and without a host sync, so that it can run inside a CUDA graph.
Grid: (bs, cdiv(longest, BLOCK)); each program copies BLOCK slots of one request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import INDEX_DTYPES, check_device, check_tensor

BLOCK = 512


@triton.jit
def _flat_slots_kernel(
    table_ptr,
    rows_ptr,
    indptr_ptr,
    out_ptr,
    stride_row,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    start = tl.load(indptr_ptr + req)
    n = tl.load(indptr_ptr + req + 1) - start
    row = tl.load(rows_ptr + req).to(tl.int64)
    mask = offs < n
    slots = tl.load(table_ptr + row * stride_row + offs, mask=mask)
    tl.store(out_ptr + start + offs, slots.to(tl.int32), mask=mask)


def kv_indptr(seq_lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[bs + 1] int32: 0, then the running sum of `seq_lens` (on their device)."""
    bs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(bs + 1, dtype=torch.int32, device=seq_lens.device)
    out[:1].zero_()
    torch.cumsum(seq_lens, 0, dtype=torch.int32, out=out[1 : bs + 1])
    return out


def flat_slots(
    *,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    indptr: torch.Tensor,
    max_len: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Writes req_to_token[req_rows[i], :indptr[i+1] - indptr[i]] at out[indptr[i]:] for each
    request i; returns `out`.

    req_to_token: [max_reqs, max_context] ints; req_rows: [bs] ints; indptr: [bs + 1] int32
    (`kv_indptr`); max_len: at least the longest request's length (it sizes the grid, so a
    CUDA graph captures it: pass the table's width there); out: int32, at least indptr[-1].
    """
    op = "flat_slots"
    check_device(op, req_to_token)
    bs = req_rows.shape[0]
    dev = req_to_token.device
    table_dims = "[max_reqs, max_context]"
    check_tensor(op, "req_to_token", req_to_token, shape=(None, None), dims=table_dims,
                 dtypes=INDEX_DTYPES)  # fmt: skip
    check_tensor(op, "req_rows", req_rows, shape=(bs,), dims="[bs]", dtypes=INDEX_DTYPES,
                 device=dev)  # fmt: skip
    check_tensor(op, "indptr", indptr, shape=(bs + 1,), dims="[bs + 1]", dtypes=(torch.int32,),
                 device=dev)  # fmt: skip
    check_tensor(op, "out", out, shape=(None,), dims="[slots]", dtypes=(torch.int32,),
                 device=dev)  # fmt: skip
    if bs == 0 or max_len <= 0:
        return out
    grid = (bs, triton.cdiv(max_len, BLOCK))
    _flat_slots_kernel[grid](
        req_to_token, req_rows, indptr, out, req_to_token.stride(0), BLOCK=BLOCK
    )
    return out


def flat_slots_ref(
    req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """The torch twin of `flat_slots` over `kv_indptr(seq_lens)` (syncs the host)."""
    rows = [req_to_token[r, :n] for r, n in zip(req_rows.tolist(), seq_lens.tolist(), strict=True)]
    if not rows:
        return torch.empty(0, dtype=torch.int32, device=req_to_token.device)
    return torch.cat(rows).to(torch.int32)
