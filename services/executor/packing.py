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

from collections.abc import Sequence

import torch

ALIGN_BYTES = 16  # Triton's pointer specialisation (tt.divisibility = 16)


def pack_aligned(
    tables: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One tensor per table, all views of one device tensor filled by one copy (see
    `upload`), each starting at a multiple of ALIGN_BYTES from the allocation's start (the
    allocators align allocations at least that much)."""
    per = ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size()
    flat: list[int] = []
    starts: list[int] = []
    for table in tables:
        starts.append(len(flat))
        flat += table
        flat += [0] * (-len(flat) % per)
    dev = upload(torch.tensor(flat, dtype=dtype), device)
    return [dev[s : s + len(t)] for s, t in zip(starts, tables, strict=True)]


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One small integer table on `device` (see `upload`)."""
    return pack_aligned([values], dtype, device)[0]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued without the host waiting for the device: on
    CUDA through pinned memory, since a pageable source makes the copy wait on the host."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
