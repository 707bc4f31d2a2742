"""FlashInferBackend (`--attention-backend flashinfer`) on a GPU: the same attention as the
torch reference for EXTEND (cached prefixes) and DECODE batches, with sliding windows and
softcaps, the same pool contents, decode replayed from a CUDA graph planned for new lengths,
and the same greedy tokens as the Triton backend from tiny models, eager and through the
engine with its CUDA graphs. FlashInfer is an optional extra (radixserve[flashinfer]) and
runs on CUDA only: without a GPU these tests are skipped, as every `gpu` test is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor.attention.torch_ref import TorchRefBackend
from services.executor.builder import EngineSettings, build_engine
from services.executor.forward_batch import ForwardMode
from services.executor.weights import load_model
from shared.model_files import resolve_model
from tests.executor.helpers import write_tiny_model
from tests.executor.test_engine import make_request
from tests.kernels.helpers import DEVICE, TOLERANCES, Tol, assert_same_bits, randn
from tests.kernels.test_triton_backend import (
    CASES,
    check_against_torch,
    clone_pool,
    greedy_with_prefix_reuse,
    make_batch,
    next_decode_step,
)

pytestmark = [pytest.mark.gpu]
# (heads, kv heads, head dim, dtype) of every test: FlashInfer compiles a module for each
# dtype, head dim and kind of mask (window, softcap) on first use, 20-70 s apiece.
SHAPE = (8, 2, 128, torch.float16)


@pytest.fixture(scope="module", autouse=True)
def flashinfer() -> Any:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return pytest.importorskip("flashinfer", reason="the optional extra radixserve[flashinfer]")


def backend(**kwargs: Any) -> Any:
    from services.executor.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(**kwargs)


def check(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    attn: dict[str, Any] | None = None,
    dense: bool = False,
) -> Any:
    """The backend against the torch reference at SHAPE; planned at the first layer, reused
    by the second. `dense`: every extend over gathered K/V (FlashInfer's ragged kernel), else
    the default rule, under which these small extends read the pool's pages."""
    tol = None
    if attn and attn.get("softcap"):
        # FlashInfer's soft cap is tanh.approx.f32 (relative error ~2^-11, measured: one
        # fp16 output in 46,080 off by 3.1e-3 where 2e-3 is allowed).
        tol = Tol(atol=4e-3, rtol=4e-3)
    fi = backend(dense_min_new_tokens=1) if dense else backend()
    check_against_torch(fi, mode, prefix_lens, extend_lens, *SHAPE, attn=attn, tol=tol)
    return fi


@pytest.mark.parametrize(
    ("mode", "prefix_lens", "extend_lens"),
    CASES,
    ids=[f"{c[0].value}-bs{len(c[1])}-max{max(c[1])}" for c in CASES],
)
def test_matches_torch_backend(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int]
) -> None:
    fi = check(mode, prefix_lens, extend_lens)
    assert not fi._dense


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [c[1:] for c in CASES if c[0] is ForwardMode.EXTEND],
    ids=[f"bs{len(c[1])}-max{max(c[1])}" for c in CASES if c[0] is ForwardMode.EXTEND],
)
def test_extend_over_gathered_kv_matches_torch_backend(
    prefix_lens: list[int], extend_lens: list[int]
) -> None:
    fi = check(ForwardMode.EXTEND, prefix_lens, extend_lens, dense=True)
    assert fi._dense


W5_CAP = {"window": 5, "softcap": 3.0, "scale": 0.2}


@pytest.mark.parametrize(
    ("case", "attn", "dense"),
    [
        pytest.param(CASES[1], W5_CAP, False, id="extend-w5-cap"),
        pytest.param(CASES[2], {"window": 9, "softcap": 2.0}, False, id="extend-w9-cap"),
        pytest.param(CASES[1], W5_CAP, True, id="gathered-w5-cap"),
        pytest.param(CASES[3], W5_CAP, False, id="decode-w5-cap"),
        pytest.param(CASES[5], {"window": 34, "softcap": 5.0}, False, id="decode-w34-cap"),
    ],
)
def test_window_and_softcap_match_torch_backend(
    case: tuple[ForwardMode, list[int], list[int]], attn: dict[str, Any], dense: bool
) -> None:
    check(*case, attn=attn, dense=dense)


def test_a_context_over_the_scratch_budget_reads_the_pages() -> None:
    """The gathered extend's scratch is bounded: a batch whose contexts would need more reads
    the pool's pages instead (the paged kernel, tested above)."""
    gen = torch.Generator().manual_seed(5)
    _, kv_heads, dim, dtype = SHAPE
    batch = make_batch(ForwardMode.EXTEND, [300, 3], [40, 40], 1, kv_heads, dim, dtype, gen)
    row_bytes = kv_heads * dim * 2
    fi = backend(dense_min_new_tokens=1, dense_max_bytes=2 * row_bytes * 382)
    fi.init_forward_metadata(batch)
    assert not fi._dense  # 383 context tokens
    fi = backend(dense_min_new_tokens=1, dense_max_bytes=2 * row_bytes * 383)
    fi.init_forward_metadata(batch)
    assert fi._dense and fi._scratch[0].shape[0] == 383


def captured_decode(
    batch: Any, gen: torch.Generator
) -> tuple[Any, torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, ...]]:
    """A backend with the decode of `batch` (3 requests, SHAPE) captured in a CUDA graph, as
    services/executor/cuda_graph.py captures it: the backend, the graph, its output tensor
    and its inputs (q, k, v)."""
    heads, kv_heads, dim, dtype = SHAPE
    fi = backend()
    fi.reserve_decode(max_batch_size=4, num_heads=heads, head_dim=dim, device=DEVICE)
    q = randn(3, heads, dim, dtype=dtype, gen=gen)
    k = randn(3, kv_heads, dim, dtype=dtype, gen=gen)
    v = randn(3, kv_heads, dim, dtype=dtype, gen=gen)

    def step() -> torch.Tensor:
        fi.init_forward_metadata(batch)
        out: torch.Tensor = fi.forward(q, k, v, 0, batch)
        return out

    fi.prepare_capture(3)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    fi.prepare_capture(None)
    return fi, graph, out, (q, k, v)


def test_decode_replays_in_a_cuda_graph_planned_for_new_lengths() -> None:
    """As services/executor/cuda_graph.py runs it: warm-up and capture of a batch size, then
    replays after prepare_replay with other sequence lengths and slots, one after another
    (each plan waits for the device to take the last one's, not for the step)."""
    gen = torch.Generator().manual_seed(2)
    _, kv_heads, dim, dtype = SHAPE
    batch = make_batch(ForwardMode.DECODE, [40, 300, 7], [1, 1, 1], 1, kv_heads, dim, dtype, gen)
    fi, graph, out, (q, k, v) = captured_decode(batch, gen)

    for new_lens in ([33, 129, 1], [34, 150, 2], [35, 200, 3]):
        twin = next_decode_step(batch, new_lens, (q, k, v), gen)
        fi.prepare_replay(3, new_lens)
        graph.replay()
        want = TorchRefBackend().forward(q, k, v, 0, twin)
        torch.testing.assert_close(out, want, **TOLERANCES[dtype])
        assert_same_bits(batch.kv_pool.k_buffers[0], twin.kv_pool.k_buffers[0])
    # FlashInfer 0.5 (the extra's pin): the replays above re-planned only the schedule
    assert fi._replannable == {id(w) for w in fi._graph.values()}


def test_a_graph_replays_requests_that_list_more_slots_than_the_pool_has() -> None:
    """Requests sharing a cached prefix each list its slots: three requests of 401 keys, 400
    of them the same, on a pool of 422 slots. The graph's slot list holds all 1,203 (it was
    sized from the pool and written past its end: a CUDA fault at 512 requests decoding)."""
    gen = torch.Generator().manual_seed(3)
    _, kv_heads, dim, dtype = SHAPE
    batch = make_batch(ForwardMode.DECODE, [400, 5, 6], [1, 1, 1], 1, kv_heads, dim, dtype, gen)
    table = batch.req_to_token.req_to_token
    rows = batch.req_rows.tolist()
    shared = table[rows[0], :400].clone()
    for row, loc in zip(rows[1:], batch.out_cache_loc.tolist()[1:], strict=True):
        table[row, :400] = shared
        table[row, 400] = loc
    batch.seq_lens.fill_(401)
    batch.prefix_lens_cpu = [400, 400, 400]
    assert batch.kv_pool.num_slots < 3 * 401
    twin = clone_pool(batch)
    fi, graph, out, (q, k, v) = captured_decode(batch, gen)
    fi.prepare_replay(3, [401, 401, 401])
    graph.replay()
    want = TorchRefBackend().forward(q, k, v, 0, twin)
    torch.testing.assert_close(out, want, **TOLERANCES[dtype])
    assert fi._g_indices is not None and fi._g_indices.numel() >= 3 * 401


# SHAPE's heads (the tiny families' own head dims are too small for FlashInfer's kernels).
TINY = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128}
PROMPTS = [[5, 9, 200, 17, 3, 88, 41, 7, 7, 1, 2, 3, 4, 5], [260, 72, 101, 108], [7] * 23]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_tiny_model_greedy_tokens_match_triton(tmp_path: Path, arch: str) -> None:
    """fp16, prefill in two chunks (the second over a cached prefix), then decode; Gemma 2's
    window of 8, softcaps and scale on its alternate layers."""
    path = write_tiny_model(tmp_path, arch, **TINY)
    results = {}
    for name in ("triton", "flashinfer"):
        model, config = load_model(path, device=DEVICE, dtype=torch.float16, attention_backend=name)
        results[name] = greedy_with_prefix_reuse(model, config, PROMPTS, steps=8)
    assert results["flashinfer"][0] == results["triton"][0]
    torch.testing.assert_close(results["flashinfer"][1], results["triton"][1], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("choice", ["flashinfer", "auto"])
def test_the_engine_with_cuda_graphs_answers_what_triton_answers(
    tmp_path: Path, choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's engine on the GPU, decode replayed from CUDA graphs (batch sizes 1-8),
    requests of different lengths finishing at different steps; `auto` with FlashInfer
    installed is FlashInfer's prefill and, here from 4 requests on (64 when serving), its
    decode, and Triton's decode below that: the batch shrinks across the line."""
    from services.executor.attention import split_backend
    from services.executor.attention.split_backend import FlashInferWithTriton

    monkeypatch.setattr(split_backend, "FLASHINFER_DECODE_MIN_BS", 4)

    path = write_tiny_model(tmp_path, "llama", **TINY)
    answers = {}
    for name in ("triton", choice):
        settings = EngineSettings(
            model=resolve_model(str(path)),
            name="e0",
            stream="rs:exec:e0",
            device="cuda",
            dtype="float16",
            attention_backend=name,
            cuda_graph_max_bs=8,
            max_total_tokens=8192,
        )
        engine = build_engine(settings)
        assert engine.runner.graphs is not None
        if name == "auto":
            backend = engine.runner.model.backend
            assert isinstance(backend, FlashInferWithTriton)
            assert backend.flashinfer_decode_min_bs == 4
        for i, p in enumerate(PROMPTS * 2):
            engine.submit(make_request(f"r{i}", p, 6 + 3 * i, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for _, out in engine.step().outputs:
                for d in getattr(out, "deltas", []):
                    tokens.setdefault(d.rid, []).extend(d.token_ids)
        engine.policy.check_integrity()
        answers[name] = tokens
    assert answers[choice] == answers["triton"]


@pytest.mark.parametrize("choice", ["flashinfer", "auto"])
def test_extends_run_as_decode_rows_answer_as_the_extend(tmp_path: Path, choice: str) -> None:
    """Short and cached prompts' extends run as decode rows replayed from the CUDA graphs
    (services/executor/extend_rows.py) on FlashInfer's decode, which plans each replay from
    the rows' host lengths (a token's position + 1): the same greedy tokens as the same engine
    extending, and logits within fp16's rounding. `auto` decodes small batches on Triton."""
    from tests.executor.test_extend_rows import Recorded, _arrivals

    path = write_tiny_model(tmp_path, "llama", **TINY)

    def engine() -> Any:
        settings = EngineSettings(
            model=resolve_model(str(path)), name="e0", stream="rs:exec:e0", device="cuda",
            dtype="float16", attention_backend=choice, max_prefill_tokens=8,
            cuda_graph_max_bs=16, max_total_tokens=8192,
        )  # fmt: skip
        return build_engine(settings)

    base, rows = Recorded(engine(), 0), Recorded(engine(), None)
    base.run.go(_arrivals(PROMPTS))
    rows.run.go(_arrivals(PROMPTS))
    assert not base.as_rows() and len(rows.as_rows()) >= 4
    assert rows.run.tokens == base.run.tokens
    for got, ref in zip(rows.logits, base.logits, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
