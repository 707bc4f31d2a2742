"""Several integer tables sent to the device in one copy, each on a 16-byte boundary.

Triton specialises a kernel on whether each pointer argument is 16-byte aligned and compiles
one binary per combination it meets. Views at arbitrary offsets of one packed tensor made
that combination a function of the batch's token and request counts (an odd token count put
`req_rows` at an 8-byte offset, a request count of 4k+2 put `extend_lens` at one), so a batch
shape the warm-up had not met compiled the extend-attention kernel again, and its requests
waited about 1.5 s for their first token on an H100: the first burst of 64 requests after a
start, whichever HTTP path it came through. Aligning every table keeps one binary per kernel.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

ALIGN_BYTES = 16  # Triton's pointer specialisation (tt.divisibility = 16)
_ZEROS = (0,) * ALIGN_BYTES  # padding between tables (at most ALIGN_BYTES - 1 elements)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def pack_aligned(
    tables: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One tensor per table, all views of one device tensor filled by one copy (see
    `upload`), each starting at a multiple of ALIGN_BYTES from the allocation's start (the
    allocators align allocations at least that much)."""
    per = ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size()
    parts: list[Sequence[int]] = []
    starts: list[int] = []
    total = 0
    for table in tables:
        starts.append(total)
        pad = -len(table) % per
        parts.append(table)
        parts.append(_ZEROS[:pad])
        total += len(table) + pad
    dev = upload(host_tensor(itertools.chain.from_iterable(parts), total, dtype), device)
    return [dev[s : s + len(t)] for s, t in zip(starts, tables, strict=True)]


def host_tensor(values: Iterable[int], count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` Python numbers as a CPU tensor. Through numpy where it can: torch.tensor of a
    list costs about four times as much (66 vs 15 us for 1,536 ints; a decode step at batch
    256 sends that many every step, a 16,384-token prefill chunk over 49,000)."""
    np_dtype = _NUMPY.get(dtype)
    if np_dtype is None:
        return torch.tensor(list(values), dtype=dtype)
    # numpy's buffers are aligned at least as Triton wants (16 bytes): glibc's malloc is
    return torch.from_numpy(np.fromiter(values, dtype=np_dtype, count=count))


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One small integer table on `device` (see `upload`)."""
    return pack_aligned([values], dtype, device)[0]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued without the host waiting for the device: on
    CUDA through pinned memory, since a pageable source makes the copy wait on the host."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
