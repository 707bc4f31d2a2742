"""Tensor parallelism on the CPU: two real processes in a gloo group.

Each rank loads only its shard of the checkpoint; rank 0 runs the engine (plans, samples) and
rank 1 follows each step's tables. Against the same model on one rank: the logits agree to
float32 rounding, and greedy generation gives the same tokens, for Llama, Qwen2 (biases),
Qwen3 (q/k norms), Gemma 3 (sliding windows), Qwen2-MoE (sharded experts) and DeepSeek-V3
(latent attention: heads sharded, the latent replicated), with KV heads that the ranks divide
and with fewer KV heads than ranks (replicated), and an odd vocabulary (padded slices).
Phi-3's stacked q/k/v and gate/up rows per rank are tested in one process
(tests/executor/test_phi3.py).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.executor.builder import EngineSettings, build_engine, build_runner
from services.executor.distributed.follower import Follower
from services.executor.distributed.group import SINGLE, TPGroup, init_group
from services.executor.distributed.node import destroy_group, exit_rank
from shared.model_files import resolve_model
from tests.conftest import free_port
from tests.executor.helpers import TINY_VOCAB_SIZE, write_tiny_model
from tests.executor.test_engine import make_request

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-kv2": ("llama", {}),
    "llama-kv1": ("llama", {"num_key_value_heads": 1}),  # fewer KV heads than ranks
    "qwen2-odd-vocab": ("qwen2", {"vocab_size": TINY_VOCAB_SIZE + 1}),
    "qwen3": ("qwen3", {"tie_word_embeddings": False}),
    # MLA: heads sharded, the latent cache replicated on both ranks.
    "deepseek-v3": ("deepseek_v3", {"q_lora_rank": 24}),
    # experts split along their intermediate size; the gated shared expert's sum and the
    # routed experts' share one all-reduce
    "qwen2-moe": ("qwen2_moe", {}),
    # sliding windows of 8, q/k norms, two RoPE bases, softcapped logits
    "gemma3": ("gemma3", {}),
    # rank 0 runs extends as decode rows (extend_rows.py; forced on the CPU), the follower
    # as the step's tables say
    "llama-rows": ("llama", {}),
}
ROWS = {"llama-rows"}
PROMPTS = [[11, 12, 13, 14, 15], [30, 31], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]
MAX_NEW = 12


def settings(path: Path) -> EngineSettings:
    return EngineSettings(
        model=resolve_model(str(path)), name="e0", stream="rs:exec:e0", device="cpu"
    )


def generate(
    path: Path, tp: TPGroup, rows: bool = False
) -> tuple[dict[str, list[int]], torch.Tensor, int]:
    """Rank 0: every prompt's greedy tokens (run together, so batched), the first step's
    logits (prefill of all prompts), and how many steps ran as decode rows (with `rows`)."""
    engine = build_engine(settings(path), tp=tp)
    if rows:
        engine.runner.rows_max = 64
    first: list[torch.Tensor] = []
    as_rows = [0]
    original = engine.runner.run

    def spy(batch: Any, extra: list[int]) -> torch.Tensor:
        logits = original(batch, extra)
        as_rows[0] += batch.sample_rows is not None
        if not first:
            first.append(logits.clone())
        return logits

    engine.runner.run = spy  # type: ignore[method-assign]
    for i, p in enumerate(PROMPTS):
        engine.submit(make_request(f"r{i}", p, MAX_NEW, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for _, out in engine.step().outputs:
            for d in getattr(out, "deltas", []):
                tokens[d.rid] += d.token_ids
    engine.policy.check_integrity()
    engine.runner.stop_followers()
    return tokens, first[0], as_rows[0]


def rank_main(rank: int, addr: str, models: list[tuple[str, str]], results: Any) -> None:
    """One rank's process, for every case's model in turn in one gloo group: rank 0 sends
    ("ok" or "error", case, result) per case and stops at the first error (rank 1 would
    wait on it). It ends through `exit_rank`, as the executor's ranks do: left to the
    interpreter's finalisation, gloo's threads aborted rank 0 at exit now and then
    ("terminate called without an active exception", status -6) after a correct run."""
    code, case = 0, "group"
    try:
        tp = init_group(rank, 2, addr, torch.device("cpu"))
        for case, path in models:
            if rank == 0:
                tokens, logits, as_rows = generate(Path(path), tp, rows=case in ROWS)
                results.put(("ok", case, (tokens, logits.tolist(), as_rows)))  # plain values
            else:
                b = build_runner(settings(Path(path)), tp=tp)
                Follower(b.runner, tp).run()
        destroy_group()
    except BaseException:
        results.put(("error", case, f"rank {rank}: {traceback.format_exc()}"))
        code = 1
    results.close()
    results.join_thread()  # the results are in the pipe before the process ends
    exit_rank(code)


@dataclass
class TwoRanks:
    """What the pair of rank processes gave: per case ("ok", (tokens, logits, rows steps)) or
    ("error", traceback), up to the first error; the ranks' exit codes; each case's model."""

    results: dict[str, tuple[str, Any]]
    exit_codes: list[int | None]
    paths: dict[str, Path]

    def result(self, case: str) -> tuple[str, Any]:
        errors = {c: r[1] for c, r in self.results.items() if r[0] == "error"}
        return self.results.get(case, ("missing", f"no result; an earlier case failed: {errors}"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> TwoRanks:
    """Every case's model through one pair of rank processes, case after case: the ranks'
    start (two spawned interpreters importing torch, and the group) is paid once, not once
    per case."""
    root = tmp_path_factory.mktemp("tp")
    paths = {
        case: write_tiny_model(root / case, arch, seed=4, **overrides)
        for case, (arch, overrides) in CASES.items()
    }
    models = [(case, str(path)) for case, path in paths.items()]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, addr, models, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[str, tuple[str, Any]] = {}
    while len(results) < len(models):
        status, case, value = queue.get(timeout=240)
        results[case] = (status, value)
        if status == "error":
            break
    for p in procs:
        p.join(60)
    return TwoRanks(results, [p.exitcode for p in procs], paths)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one(case: str, two_ranks: TwoRanks) -> None:
    want_tokens, want_logits, _ = generate(two_ranks.paths[case], SINGLE)
    status, got = two_ranks.result(case)
    assert status == "ok", got
    assert two_ranks.exit_codes == [0, 0]
    tokens, logits, as_rows = got
    assert (as_rows > 0) == (case in ROWS)
    torch.testing.assert_close(torch.tensor(logits), want_logits, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens
    assert all(len(t) == MAX_NEW for t in tokens.values())
