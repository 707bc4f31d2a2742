"""Which attention backend runs: `auto` (torch on the CPU; Triton on CUDA, with FlashInfer's
prefill and large decode batches when radixserve[flashinfer] is installed and the cache is in
the model's dtype), the split backend's dispatch by forward mode and batch size, FlashInfer's
choice of the gathered prefill, and clear refusals for what FlashInfer cannot run."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from services.executor.attention import auto_backend, flashinfer_backend, get_backend
from services.executor.attention.flashinfer_backend import FlashInferBackend
from services.executor.attention.split_backend import FlashInferWithTriton
from services.executor.builder import check_flashinfer_model, pick_kv_dtype
from services.executor.forward_batch import ForwardMode


def with_flashinfer(monkeypatch: pytest.MonkeyPatch, installed: bool, imports: bool = True) -> None:
    """Pretend FlashInfer is installed (or not), and that importing it works (or fails)."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name == "flashinfer":
            return object() if installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(sys.modules, "flashinfer", ModuleType("flashinfer") if imports else None)


@pytest.mark.parametrize(
    ("device", "model_dtype_cache", "installed", "want"),
    [
        ("cpu", True, True, "torch"),
        ("cuda", True, False, "triton"),
        ("cuda", True, True, "triton+flashinfer"),
        ("cuda", False, True, "triton"),  # an fp8 cache
    ],
)
def test_auto_picks_by_device_cache_and_what_is_installed(
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    model_dtype_cache: bool,
    installed: bool,
    want: str,
) -> None:
    with_flashinfer(monkeypatch, installed)
    assert auto_backend(device, model_dtype_cache) == want


def test_auto_serves_on_triton_when_flashinfer_is_installed_but_broken(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_flashinfer(monkeypatch, installed=True, imports=False)
    assert auto_backend("cuda", True) == "triton"
    assert "does not import" in caplog.text


def test_flashinfer_missing_is_an_error_that_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer raises
    with pytest.raises(ImportError, match=r"pip install 'radixserve\[flashinfer\]'"):
        get_backend("flashinfer")


def test_flashinfer_refuses_the_cpu_and_an_fp8_cache() -> None:
    with pytest.raises(ValueError, match="CUDA devices only"):
        pick_kv_dtype("auto", torch.bfloat16, torch.device("cpu"), "flashinfer")
    with pytest.raises(ValueError, match="fp8_e4m3 needs the triton backend"):
        pick_kv_dtype("fp8_e4m3", torch.bfloat16, torch.device("cuda"), "flashinfer")
    assert pick_kv_dtype("auto", torch.bfloat16, torch.device("cuda"), "flashinfer") == (
        torch.bfloat16
    )


class Recorder:
    """Stands in for a backend: records which calls reached it."""

    def __init__(self, name: str, calls: list[tuple[str, str]]) -> None:
        self.name, self.calls = name, calls

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> str:
            self.calls.append((self.name, method))
            return self.name

        return call


def test_the_split_backend_sends_prefill_and_large_decode_batches_to_flashinfer() -> None:
    calls: list[tuple[str, str]] = []
    split = object.__new__(FlashInferWithTriton)
    split.triton = Recorder("triton", calls)  # type: ignore[assignment]
    split.flashinfer = Recorder("flashinfer", calls)  # type: ignore[assignment]
    split.flashinfer_decode_min_bs = 4
    q = torch.zeros(1, 1, 1)
    pool = SimpleNamespace(k_buffers=[torch.zeros(1, 1, 128)])  # head dim 128
    decode = SimpleNamespace(mode=ForwardMode.DECODE, batch_size=3, kv_pool=pool)
    big_decode = SimpleNamespace(mode=ForwardMode.DECODE, batch_size=4, kv_pool=pool)
    extend = SimpleNamespace(mode=ForwardMode.EXTEND, batch_size=1, kv_pool=pool)

    split.init_forward_metadata(decode)  # type: ignore[arg-type]
    assert calls == [("triton", "init_forward_metadata")]
    assert split.forward(q, q, q, 0, decode) == "triton"  # type: ignore[arg-type]
    calls.clear()
    split.init_forward_metadata(big_decode)  # type: ignore[arg-type]
    # Triton's too: latent-attention layers run on it in every case
    assert calls == [("triton", "init_forward_metadata"), ("flashinfer", "init_forward_metadata")]
    assert split.forward(q, q, q, 0, big_decode) == "flashinfer"  # type: ignore[arg-type]
    assert split.forward_mla(q, None, 0, big_decode, 1.0, 1) == "triton"  # type: ignore[arg-type]
    calls.clear()
    split.init_forward_metadata(extend)  # type: ignore[arg-type]
    assert calls == [("triton", "init_forward_metadata"), ("flashinfer", "init_forward_metadata")]
    assert split.forward(q, q, q, 0, extend, window=4) == "flashinfer"  # type: ignore[arg-type]
    assert split.forward_mla(q, None, 0, extend, 1.0, 1) == "triton"  # type: ignore[arg-type]
    calls.clear()
    # CUDA graphs: both reserve; only FlashInfer's graphs are planned, and only theirs
    split.reserve_decode(max_batch_size=8, num_heads=1, head_dim=1, device="cpu")
    assert calls == [("triton", "reserve_decode"), ("flashinfer", "reserve_decode")]
    calls.clear()
    split.prepare_capture(8)
    split.prepare_replay(3, [5, 6, 7])
    split.prepare_replay(8, [5] * 8)
    assert calls == [("flashinfer", "prepare_capture"), ("flashinfer", "prepare_replay")]
    calls.clear()
    # a head dim FlashInfer's kernels do not take: Triton for everything
    small = SimpleNamespace(k_buffers=[torch.zeros(1, 1, 16)])
    for mode, bs in ((ForwardMode.EXTEND, 1), (ForwardMode.DECODE, 8)):
        batch = SimpleNamespace(mode=mode, batch_size=bs, kv_pool=small)
        split.init_forward_metadata(batch)  # type: ignore[arg-type]
        assert split.forward(q, q, q, 0, batch) == "triton"  # type: ignore[arg-type]
    assert ("flashinfer", "init_forward_metadata") not in calls


def test_flashinfer_refuses_latent_attention_and_head_dims_it_cannot_run() -> None:
    cfg = SimpleNamespace(mla=None, head_dim=128, architecture="LlamaForCausalLM")
    check_flashinfer_model(cfg)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="runs head dims 64, 128, 256; Phi3ForCausalLM's is 96"):
        check_flashinfer_model(
            SimpleNamespace(mla=None, head_dim=96, architecture="Phi3ForCausalLM")  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="no latent"):
        check_flashinfer_model(
            SimpleNamespace(mla=object(), head_dim=192, architecture="DeepseekV3ForCausalLM")  # type: ignore[arg-type]
        )


def extend_batch(new: list[int], prefix: list[int]) -> Any:
    """What FlashInferBackend's choice reads of a prefill: lengths and the pool's K row shape
    (8 KV heads of 16 fp32: 512 bytes a token)."""
    return SimpleNamespace(
        extend_lens_cpu=new,
        seq_lens_cpu=[n + p for n, p in zip(new, prefix, strict=True)],
        batch_size=len(new),
        kv_pool=SimpleNamespace(k_buffers=[torch.zeros(4, 8, 16)]),
    )


def test_the_gathered_prefill_is_taken_for_long_new_runs_within_its_scratch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fi = object.__new__(FlashInferBackend)  # its kernels need CUDA; the choice does not
    fi.dense_min_new_tokens, fi.dense_max_bytes, fi._scratch = 1024, 2 * 512 * 10_000, None
    assert not fi._dense_extend(extend_batch([900, 1100], [0, 0]))  # 1,000 a request: short
    assert fi._dense_extend(extend_batch([2048], [1000]))
    assert fi._scratch is not None and fi._scratch[0].shape == (3048, 8, 16)
    assert fi._dense_extend(extend_batch([2048, 2048], [0, 500]))  # 4,596: grown by doubling
    assert fi._scratch[0].shape[0] == 6096 and fi._scratch[1].shape[0] == 6096
    assert not fi._dense_extend(extend_batch([4096, 4096], [1000, 1000]))  # 10,192 > 10,000
    assert fi._scratch[0].shape[0] == 6096  # kept for the next batch that fits

    def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(flashinfer_backend.torch, "empty", no_memory)
    assert not fi._dense_extend(extend_batch([8000], [0]))  # reads pages, does not crash
    assert fi._scratch is None and fi.dense_max_bytes == 0
    assert not fi._dense_extend(extend_batch([2048], [0]))  # and from now on


class FakeDecodeWrapper:
    """FlashInfer 0.5's graph decode wrapper as `_replan` sees it: `plan` (the full one)
    records its arguments and sets what the short path reuses; the compiled planner records
    the lengths it is given."""

    is_cuda_graph_enabled = True

    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls
        self._paged_kv_indptr_buf = torch.zeros(4, dtype=torch.int32)
        self._float_workspace_buffer = self._int_workspace_buffer = torch.zeros(1)
        self._pin_memory_int_workspace_buffer = torch.zeros(1)
        self._plan_info: Any = None
        self._max_kv_len: int | None = None

        def compiled_plan(*args: Any) -> list[int]:
            qo, kv_indptr, kv_lens = args[3:6]
            calls.append(("planner", (qo.tolist(), kv_indptr.tolist(), kv_lens.tolist())))
            calls.append(("planner window", args[15]))
            return [len(calls)]

        self._cached_module = SimpleNamespace(plan=compiled_plan)

    def plan(self, indptr: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("plan", indptr.tolist()))
        self._paged_kv_indptr_buf.copy_(indptr)


class NoEvent:
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


@pytest.mark.parametrize(("version", "short"), [("0.5.3", True), ("0.6.0", False)])
def test_graph_replays_replan_only_the_schedule_on_known_flashinfer_versions(
    monkeypatch: pytest.MonkeyPatch, version: str, short: bool
) -> None:
    """A graph wrapper is planned in full once; later replays of FlashInfer 0.5 run its compiled
    planner on the new lengths (FlashInfer's Python plan costs ~0.8 ms at 256 requests);
    an unknown version plans in full every time."""
    monkeypatch.setattr(flashinfer_backend.torch.cuda, "Event", NoEvent)
    fi = object.__new__(FlashInferBackend)
    fi.fi = SimpleNamespace(__version__=version)
    fi._plan_done, fi._replannable, fi._graph = {}, set(), {}
    fi._can_replan = version.startswith(flashinfer_backend.REPLAN_VERSIONS)
    fi._shape = (8, 2, 128, torch.float16, torch.float16)
    fi._indices = torch.zeros(0, dtype=torch.int32)
    fi._ones_host = torch.ones(8, dtype=torch.int32)
    calls: list[tuple[str, Any]] = []
    wrapper = FakeDecodeWrapper(calls)
    fi._graph[(3, (4, 0.0, 0.1))] = wrapper  # a window of 4: window_left 3

    fi.prepare_replay(3, [5, 6, 7])
    assert calls == [("plan", [0, 5, 11, 18])]
    calls.clear()
    fi.prepare_replay(3, [6, 9, 1])
    if short:
        planned = ([0, 1, 2, 3], [0, 6, 15, 16], [6, 9, 1])  # queries, keys, lengths
        assert calls == [("planner", planned), ("planner window", 3)]
        assert wrapper._plan_info == [2] and wrapper._max_kv_len == 9
    else:
        assert calls == [("plan", [0, 6, 15, 16])]
    assert wrapper._paged_kv_indptr_buf.tolist() == [0, 6, 15, 16]  # the graph reads this
