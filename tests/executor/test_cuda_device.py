"""The stepping thread makes the engine's GPU current: CUDA's current device is per thread
and a new thread starts on GPU 0, where Triton would launch with pointers to another GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from services.executor import cuda_device


@pytest.fixture
def set_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.device]]:
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d))
    )
    return calls


def test_each_thread_makes_the_gpu_current_once(set_calls: list) -> None:
    gpu1 = torch.device("cuda:1")

    def step_twice() -> None:
        cuda_device.make_current(gpu1)
        cuda_device.make_current(gpu1)

    threads = [threading.Thread(target=step_twice, name=f"step-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set_calls) == [("step-0", gpu1), ("step-1", gpu1)]


def test_a_thread_moved_to_another_gpu_sets_it_again(set_calls: list) -> None:
    def run() -> None:
        for d in ("cuda:1", "cuda:1", "cuda:0"):
            cuda_device.make_current(torch.device(d))

    t = threading.Thread(target=run, name="mover")
    t.start()
    t.join()
    assert [d for _, d in set_calls] == [torch.device("cuda:1"), torch.device("cuda:0")]


def test_cpu_and_the_unindexed_cuda_device_leave_the_current_device(set_calls: list) -> None:
    cuda_device.make_current(torch.device("cpu"))
    cuda_device.make_current(torch.device("cuda"))  # "the current one": nothing to choose
    assert set_calls == []


def test_engine_step_makes_its_runner_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.executor.engine import loop

    seen: list[torch.device] = []
    monkeypatch.setattr(loop, "make_current", seen.append)

    class Runner:
        device = torch.device("cuda:1")

    engine = loop.Engine.__new__(loop.Engine)
    engine.runner = Runner()  # type: ignore[assignment]
    with pytest.raises(AttributeError):  # the rest of the step needs a whole engine
        engine.step()
    assert seen == [torch.device("cuda:1")]
