"""FlashInfer's attention kernels beside ours, on the same pool (issue 24, benchmark 3).

Llama-3.1-8B's attention shapes (32 query heads over 8 KV heads of 128, bf16), one layer:
decode at batch 1, 64 and 256 over contexts of 1K to 32K keys, and extend of 2,048 and 8,192
new tokens of one request with and without a cached prefix of 4,096. Each request's slots are
scattered over the pool, read through the request table: FlashInfer sees them as pages of one
token (`kv_indices`), as the flashinfer backend gives them. Our side runs
TritonBackend.forward as a step launches it. Every timing replays a CUDA graph of REPS
launches (FlashInfer's plan, host work done once per step for every layer, stays outside),
and each point checks that the two outputs agree.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from loadtest.gpu.mla_kernel import copy_bandwidth, graph_seconds
from services.executor.attention.triton_backend import TritonBackend
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool

HEADS, KV_HEADS, DIM = 32, 8, 128
DECODE_BATCHES = (1, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
MAX_POOL_TOKENS = 2**22  # 16 GiB of K and V: bs 256 stops at 16K keys
EXTENDS = ((2048, 0), (2048, 4096), (8192, 0), (8192, 4096))  # (new tokens, cached prefix)
WORKSPACE_BYTES = 256 * 2**20


def batch_on_pool(
    mode: ForwardMode, lens: list[tuple[int, int]], gen: torch.Generator
) -> ForwardBatch:
    """Requests of (prefix, new) tokens on shuffled slots of a one-layer pool, K/V random and
    the new tokens' already stored."""
    total = sum(p + n for p, n in lens)
    pool = KVPool(total, 1, KV_HEADS, DIM, torch.bfloat16, "cuda")
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    longest = max(p + n for p, n in lens)
    table = ReqToTokenPool(len(lens), longest, "cuda", pad_slot=pool.pad_slot)
    perm = torch.randperm(total, device="cuda", generator=gen)
    at, new_slots = 0, []
    for row, (p, n) in enumerate(lens):
        table.req_to_token[row, : p + n] = perm[at : at + p + n]
        new_slots.append(perm[at + p : at + p + n])
        at += p + n
    bs = len(lens)
    num_new = sum(n for _, n in lens)
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(num_new, dtype=torch.int64, device="cuda"),
        positions=torch.zeros(num_new, dtype=torch.int64, device="cuda"),
        out_cache_loc=torch.cat(new_slots),
        req_rows=torch.arange(bs, device="cuda"),
        seq_lens=torch.tensor([p + n for p, n in lens], dtype=torch.int64, device="cuda"),
        prefix_lens_cpu=[p for p, _ in lens],
        extend_lens_cpu=[n for _, n in lens],
        kv_pool=pool,
        req_to_token=table,
    )


def page_table(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr, kv_indices, last_page_len) of the batch: pages of one slot."""
    lens = [p + n for p, n in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True)]
    table = batch.req_to_token.req_to_token
    indices = torch.cat([table[r, :n] for r, n in enumerate(lens)]).to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return indptr.cuda(), indices, torch.ones(len(lens), dtype=torch.int32, device="cuda")


def paged(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V as FlashInfer's NHD pages of one token."""
    k, v = batch.kv_pool.k_buffers[0], batch.kv_pool.v_buffers[0]
    return k.view(k.shape[0], 1, KV_HEADS, DIM), v.view(v.shape[0], 1, KV_HEADS, DIM)


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest |difference| relative to the outputs' largest magnitude."""
    return float((ours.float() - theirs.float()).abs().max() / ours.float().abs().max())


def decode_point(
    fi: Any, bs: int, context: int, copy_bw: float, ws: torch.Tensor
) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(bs * 7 + context)
    batch = batch_on_pool(ForwardMode.DECODE, [(context - 1, 1)] * bs, gen)
    q = torch.randn(bs, HEADS, DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    scale = DIM**-0.5
    read = bs * context * KV_HEADS * DIM * 2 * 2  # K and V bytes per layer
    backend = TritonBackend()
    backend.reserve_decode(max_batch_size=bs, num_heads=HEADS, head_dim=DIM, device="cuda")
    out: dict[str, torch.Tensor] = {}

    def ours() -> None:
        backend.init_forward_metadata(batch)
        out["ours"] = backend.forward(q, q, q, 0, batch, scale=scale, kv_stored=True)

    triton_s = graph_seconds(ours)
    result: dict[str, Any] = {
        "bs": bs,
        "context": context,
        "kv_bytes": read,
        "triton_us": 1e6 * triton_s,
        "triton_of_copy": read / triton_s / copy_bw,
    }
    indptr, indices, last = page_table(batch)
    for tc in (False, True):
        name = "flashinfer_tc" if tc else "flashinfer"
        t0 = time.time()
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        wrapper.plan(
            indptr, indices, last, HEADS, KV_HEADS, DIM, 1,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale,
        )  # fmt: skip
        kv = paged(batch)

        def theirs(w: Any = wrapper, key: str = name, kv: Any = kv) -> None:
            out[key] = w.run(q, kv)

        theirs()
        torch.cuda.synchronize()
        first_s = time.time() - t0
        s = graph_seconds(theirs)
        result |= {
            f"{name}_us": 1e6 * s,
            f"{name}_of_copy": read / s / copy_bw,
            f"{name}_first_call_s": first_s,
            f"{name}_max_rel_diff": compare(out["ours"], out[name]),
        }
    return result


def extend_point(fi: Any, new: int, prefix: int, ws: torch.Tensor) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(new + prefix)
    batch = batch_on_pool(ForwardMode.EXTEND, [(prefix, new)], gen)
    q = torch.randn(new, HEADS, DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    scale = DIM**-0.5
    flops = 4 * HEADS * DIM * (new * prefix + new * (new + 1) / 2)  # causal QK and PV
    backend = TritonBackend()
    out: dict[str, torch.Tensor] = {}

    def ours() -> None:
        backend.init_forward_metadata(batch)
        out["ours"] = backend.forward(q, q, q, 0, batch, scale=scale, kv_stored=True)

    ours()  # compile before the graph (the extend metadata is built on the host)
    triton_s = graph_seconds(ours, reps=5)
    indptr, indices, last = page_table(batch)
    qo_indptr = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    t0 = time.time()
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wrapper.plan(
        qo_indptr, indptr, indices, last, HEADS, KV_HEADS, DIM, 1, causal=True,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale,
    )  # fmt: skip
    kv = paged(batch)

    def theirs() -> None:
        out["fi"] = wrapper.run(q, kv)

    theirs()
    torch.cuda.synchronize()
    first_s = time.time() - t0
    fi_s = graph_seconds(theirs, reps=5)
    result = {
        "new_tokens": new,
        "prefix": prefix,
        "tflop": flops / 1e12,
        "triton_ms": 1e3 * triton_s,
        "triton_TFLOPs": flops / triton_s / 1e12,
        "flashinfer_ms": 1e3 * fi_s,
        "flashinfer_TFLOPs": flops / fi_s / 1e12,
        "flashinfer_first_call_s": first_s,
        "max_rel_diff": compare(out["ours"], out["fi"]),
    }
    return result


def flashinfer_kernel_section() -> dict[str, Any]:
    t0 = time.time()
    try:
        import flashinfer
    except Exception as e:  # not installed, or its import failed on this machine: say which
        return {"error": f"import flashinfer: {e!r}"}
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    copy_bw = copy_bandwidth()
    decode, extend, errors = [], [], []
    for bs in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            if bs * ctx <= MAX_POOL_TOKENS:
                try:
                    decode.append(decode_point(flashinfer, bs, ctx, copy_bw, ws))
                    print(decode[-1], flush=True)
                    torch.cuda.empty_cache()  # this point's pool, before the next one
                except Exception as e:  # report the point and go on with the next
                    errors.append(f"decode bs {bs} ctx {ctx}: {e!r}"[:2000])
                    print(errors[-1], flush=True)
    for new, prefix in EXTENDS:
        try:
            extend.append(extend_point(flashinfer, new, prefix, ws))
            print(extend[-1], flush=True)
            torch.cuda.empty_cache()
        except Exception as e:
            errors.append(f"extend {new} prefix {prefix}: {e!r}"[:2000])
            print(errors[-1], flush=True)
    return {
        "gpu": torch.cuda.get_device_name(),
        "flashinfer": getattr(flashinfer, "__version__", "?"),
        "torch": torch.__version__,
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "dtype": "bfloat16"},
        "copy_bandwidth_TBps": copy_bw / 1e12,
        "decode": decode,
        "extend": extend,
        "errors": errors,
        "seconds": time.time() - t0,
    }
