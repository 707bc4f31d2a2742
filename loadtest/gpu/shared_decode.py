"""The `shared_decode` section: the Triton decode attention kernel over shared prefixes.

    python -m loadtest.gpu_bench --sections shared_decode

One layer of Llama-3.1-8B's attention (32 query heads, 8 KV heads of 128, bf16), 256
requests: each with 2,304 keys of its own, or 2,048 shared by a group of 4 or 16 (as in the
generated-shared-prefix workload, where the radix cache hands every request of a group the
same slots) plus 256 of its own, with the batch's rows sorted by group or shuffled. Reported
in TB/s twice: counting every request's keys (what the kernel reads through L2) and each key
once (what must come from memory). Then the launch parameters at issue 26's 256 x 512 row
(256 requests of 768 keys, none shared).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from kernels.decode_attention import DecodeWorkspace, decode_attention, num_kv_splits_for
from loadtest.gpu.models import LLAMA_3_1_8B
from loadtest.gpu.prefill import _events_ms

BATCH = 256
# (block_n, stages, warps, split cap, min split length): the backend's own first
LAUNCHES = (
    (32, 3, 4, 8, 256),
    (64, 3, 4, 8, 256),
    (32, 4, 4, 8, 256),
    (32, 3, 8, 8, 256),
    (32, 3, 2, 8, 256),
    (64, 2, 4, 8, 256),
    (32, 3, 4, 8, 128),
    (32, 3, 4, 8, 512),
    (16, 4, 4, 8, 256),
)


def request_table(
    group: int, prefix: int, own: int, shuffled: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The request table (group == 0: no sharing), the batch's rows, and the slots used."""
    ctx = prefix + own
    table = torch.zeros(BATCH, ctx, dtype=torch.int32)
    shared = {}
    nxt = 0
    for b in range(BATCH):
        if group:
            g = b // group
            if g not in shared:
                shared[g] = torch.arange(nxt, nxt + prefix, dtype=torch.int32)
                nxt += prefix
            table[b] = torch.cat([shared[g], torch.arange(nxt, nxt + own, dtype=torch.int32)])
            nxt += own
        else:
            table[b] = torch.arange(nxt, nxt + ctx, dtype=torch.int32)
            nxt += ctx
    rows = list(range(BATCH))
    if shuffled:
        random.Random(0).shuffle(rows)
    return table, torch.tensor(rows, dtype=torch.int32), nxt


def point(
    group: int, prefix: int, own: int, shuffled: bool, launch: tuple[int, ...] = LAUNCHES[0]
) -> dict[str, Any]:
    heads, kv_heads = LLAMA_3_1_8B["num_attention_heads"], LLAMA_3_1_8B["num_key_value_heads"]
    dim = LLAMA_3_1_8B["head_dim"]
    block_n, stages, warps, cap, split_len = launch
    table, rows, slots = request_table(group, prefix, own, shuffled)
    table, rows = table.cuda(), rows.cuda()
    k_buf = torch.randn(slots, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    seq_lens = torch.full((BATCH,), prefix + own, dtype=torch.int32, device="cuda")
    splits = num_kv_splits_for(seq_lens, max_kv_splits=cap, min_split_len=split_len)
    ws = DecodeWorkspace.allocate(
        max_batch_size=BATCH, num_heads=heads, head_dim=dim, max_kv_splits=cap, device="cuda"
    )
    q = torch.randn(BATCH, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    us = 1000 * _events_ms(
        lambda: decode_attention(
            q=q,
            k_buffer=k_buf,
            v_buffer=v_buf,
            req_to_token=table,
            req_rows=rows,
            seq_lens=seq_lens,
            num_kv_splits=splits,
            workspace=ws,
            sm_scale=dim**-0.5,
            out=out,
            block_n=block_n,
            num_stages=stages,
            num_warps=warps,
        ),
        reps=20,
    )
    key_bytes = kv_heads * dim * 2 * 2  # K and V, bf16
    return {
        "group": group,
        "prefix": prefix,
        "own": own,
        "order": "shuffled" if shuffled else "sorted",
        "launch": dict(
            zip(("block_n", "stages", "warps", "cap", "split_len"), launch, strict=True)
        ),
        "us": us,
        "logical_TBps": BATCH * (prefix + own) * key_bytes / us / 1e6,
        "unique_TBps": slots * key_bytes / us / 1e6,
    }


def shared_decode_section() -> dict[str, Any]:
    points = [point(0, 0, 2304, False)]
    for group in (4, 16):
        for shuffled in (False, True):
            points.append(point(group, 2048, 256, shuffled))
    for launch in LAUNCHES:
        points.append(point(0, 0, 768, False, launch))
    for p in points:
        print(p, flush=True)
    return {"gpu": torch.cuda.get_device_name(), "points": points}
