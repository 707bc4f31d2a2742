"""--kv-cache-dtype: an fp8 KV pool on the CPU (torch reference attention) stays close to the
full-precision one, runs through the engine exactly as its reference does, and holds twice
the tokens of a bf16 pool in the same memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.executor.builder import (
    EngineSettings,
    kv_pool_tokens,
    pick_kv_dtype,
)
from services.executor.main import parse_args
from services.executor.model_config import ModelConfig
from services.executor.weights import load_model
from shared.model_files import resolve_model
from tests.executor.helpers import BatchDriver, greedy_generate, write_tiny_model
from tests.executor.test_engine import Run, make_engine, make_request, prompts

SEED = 3
FP8 = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("kvdtype"), "llama", seed=SEED)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> tuple[torch.nn.Module, ModelConfig]:
    return load_model(tiny_dir, device="cpu", attention_backend="torch")


def forced_logits(
    model: torch.nn.Module,
    config: ModelConfig,
    ps: list[list[int]],
    steps: int,
    kv_dtype: torch.dtype | None,
    forced: list[list[int]] | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill in two chunks (the second attends to a cached prefix), then `steps` decode
    steps fed `forced[step]` (default: greedy). Returns the logits of every step,
    [steps + 1, len(ps), vocab], and the tokens fed."""
    driver = BatchDriver(model, config, max_reqs=len(ps), kv_dtype=kv_dtype)
    rows = [driver.new_request() for _ in ps]
    driver.extend(rows, [p[: len(p) // 2] for p in ps])
    logits = [driver.extend(rows, [p[len(p) // 2 :] for p in ps])]
    fed = []
    for step in range(steps):
        tokens = logits[-1].argmax(-1).tolist() if forced is None else forced[step]
        fed.append(tokens)
        logits.append(driver.decode(rows, tokens))
    return torch.stack(logits), fed


# The bound on the logits' relative RMS error is the format's largest relative rounding
# error (half a unit in the last place: 2^-4 for e4m3's 3 mantissa bits, 2^-3 for e5m2's
# 2): K/V rounding errors average out in attention and the residual stream, and on this
# model the measured error is 0.035 (e4m3) and 0.06 (e5m2), well inside it; a broken
# cast or a misread pool gives errors of order 1.
@pytest.mark.parametrize(("name", "bound"), [("fp8_e4m3", 2.0**-4), ("fp8_e5m2", 2.0**-3)])
def test_fp8_logits_stay_close_to_full_precision(
    tiny: tuple[torch.nn.Module, ModelConfig], name: str, bound: float
) -> None:
    """Every step along the full-precision greedy path: logits within the bound, and the
    same greedy choice at 90% of the steps or more (free-running greedy sequences would
    part at the first near-tie and compare nothing after it)."""
    model, config = tiny
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 7, 23, 60, 100, 150)]
    full, path = forced_logits(model, config, ps, 30, None)
    fp8, _ = forced_logits(model, config, ps, 30, FP8[name], forced=path)
    rel = ((fp8 - full).pow(2).mean().sqrt() / full.pow(2).mean().sqrt()).item()
    assert 0 < rel <= bound, f"relative RMS logit error {rel:.4f}"
    agree = (fp8.argmax(-1) == full.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"greedy choices agree at {agree:.1%} of the steps"


@pytest.mark.parametrize(("name", "chunk"), [("fp8_e4m3", 8192), ("fp8_e5m2", 7)])
def test_engine_with_fp8_pool_matches_its_reference(
    tiny_dir: Path, tiny: tuple[torch.nn.Module, ModelConfig], name: str, chunk: int
) -> None:
    """Continuous batching, chunked prefill (chunk 7: later chunks read their prefix back
    from the fp8 pool) and the pool accounting work unchanged over an fp8 pool: greedy tokens
    equal a plain batched greedy run over a pool of the same dtype."""
    ps = prompts(8)
    engine = make_engine(tiny_dir, kv_cache_dtype=name, max_prefill_tokens=chunk)
    assert engine.policy.kv.dtype == FP8[name]
    run = Run(engine)  # checks the pool's integrity after every step
    run.go({0: [make_request(f"r{i}", p) for i, p in enumerate(ps)]})
    model, config = tiny
    want = greedy_generate(model, config, ps, 24, kv_dtype=FP8[name])
    assert [run.tokens[f"r{i}"] for i in range(len(ps))] == want


def test_fp8_pool_holds_twice_the_tokens_of_bf16(tiny_dir: Path) -> None:
    """The same memory budget: the CPU's default pool and a GPU's --mem-fraction-static."""
    pools = {
        name: make_engine(tiny_dir, dtype="bfloat16", kv_cache_dtype=name).policy.kv
        for name in ("auto", *FP8)
    }
    assert pools["auto"].dtype == torch.bfloat16
    for name in FP8:
        assert pools[name].dtype == FP8[name]
        assert pools[name].num_slots == 2 * pools["auto"].num_slots
        # Equal bytes but for the padding slot's (one slot of each pool).
        per_slot = pools[name].nbytes() / (pools[name].num_slots + 1)
        assert pools[name].nbytes() + per_slot == pools["auto"].nbytes()


def test_gpu_pool_sizing_follows_the_kv_dtype(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ModelConfig.from_hf_dir(tiny_dir)
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * gib, 80 * gib))
    s = EngineSettings(model=resolve_model(str(tiny_dir)), name="e", stream="s")
    cuda = torch.device("cuda")
    bf16 = kv_pool_tokens(s, config, torch.bfloat16, torch.bfloat16, cuda)
    # 70 GiB free minus 15% of 80 GiB, over 2 (K, V) x 2 layers x 2 heads x 16 x 2 bytes.
    assert bf16 == int((70 - 0.15 * 80) * gib) // 256
    for kv_dtype in FP8.values():
        assert kv_pool_tokens(s, config, torch.bfloat16, kv_dtype, cuda) == 2 * bf16


def test_kv_cache_dtype_is_checked_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_kv_dtype("auto", torch.float32, cpu, "torch") == torch.float32
    assert pick_kv_dtype("fp8_e4m3", torch.float32, cpu, "torch") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"--kv-cache-dtype='fp8': unknown; choose one of auto"):
        pick_kv_dtype("fp8", torch.float32, cpu, "torch")
    # Triton's e4m3 needs compute capability 8.9; e5m2 runs on older GPUs.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"NVIDIA A100 is 8.0: use fp8_e5m2"):
        pick_kv_dtype("fp8_e4m3", torch.bfloat16, cuda, "triton")
    assert pick_kv_dtype("fp8_e5m2", torch.bfloat16, cuda, "triton") == torch.float8_e5m2


def test_flag_and_environment_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).kv_cache_dtype == "auto"
    assert parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    monkeypatch.setenv("RADIXSERVE_KV_CACHE_DTYPE", "fp8_e4m3")
    assert parse_args([]).kv_cache_dtype == "fp8_e4m3"
    # A bad value in the environment stops at start too, as one on the command line does.
    monkeypatch.setenv("RADIXSERVE_KV_CACHE_DTYPE", "fp8")
    with pytest.raises(SystemExit):
        parse_args([])
