"""`radixserve serve --dp-size N`: N executor children, each on its own device where there
are GPUs enough, and a clear refusal where several would share one GPU unsized."""

from __future__ import annotations

import pytest

from radixserve import launcher


@pytest.mark.parametrize(
    ("device", "dp", "gpus", "want"),
    [
        ("cpu", 2, 0, ["cpu", "cpu"]),
        ("auto", 2, 0, ["auto", "auto"]),  # no GPU: auto means the CPU for both
        ("auto", 2, 4, ["cuda:0", "cuda:1"]),
        ("cuda", 3, 8, ["cuda:0", "cuda:1", "cuda:2"]),
        ("cuda:2", 2, 4, ["cuda:2", "cuda:3"]),  # --device names the first GPU
        ("cuda:2", 3, 4, ["cuda:2", "cuda:3", "cuda:2"]),  # fewer GPUs: round again
        ("auto", 2, 1, ["cuda:0", "cuda:0"]),  # one GPU: they share it
    ],
)
def test_each_executor_gets_the_next_gpu(device: str, dp: int, gpus: int, want: list[str]) -> None:
    assert launcher.executor_devices(device, dp, gpus) == want


def test_dp_size_starts_that_many_executors_with_their_devices() -> None:
    a = launcher.parse_args(["--dp-size", "3", "--device", "cpu", "--tokenizer-replicas", "2"])
    specs = launcher.child_specs(a)
    executors = [s for s in specs if s.service == "executor"]
    assert [s.name for s in executors] == ["executor-0", "executor-1", "executor-2"]
    assert all(s.argv[-3:] == ["executor", "--device", "cpu"] for s in executors)
    assert sum(s.service == "tokenizer" for s in specs) == 2
    assert all(s.env["RADIXSERVE_DP_SIZE"] == "3" for s in specs)
    # One executor: its command is what it always was (the device from the environment).
    (single,) = [
        s for s in launcher.child_specs(launcher.parse_args([])) if s.service == "executor"
    ]
    assert single.argv[-1] == "executor"


@pytest.mark.parametrize("device", ["cuda", "auto", "cuda:1"])
def test_a_device_with_or_without_an_index_is_accepted(device: str) -> None:
    """`--device cuda` (no index) once failed parsing its index for the GPU-sharing check."""
    a = launcher.parse_args(["--device", device])
    assert a.executor_devices == [device]


def test_executors_sharing_a_gpu_need_their_pool_sizes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "_gpu_count", lambda device: 1)
    with pytest.raises(SystemExit):
        launcher.parse_args(["--dp-size", "2"])
    err = capsys.readouterr().err
    assert "2 executors would share a GPU (cuda:0, cuda:0)" in err
    assert "--max-total-tokens" in err
    a = launcher.parse_args(["--dp-size", "2", "--max-total-tokens", "100000"])
    assert a.executor_devices == ["cuda:0", "cuda:0"]
    monkeypatch.setattr(launcher, "_gpu_count", lambda device: 2)
    assert launcher.parse_args(["--dp-size", "2"]).executor_devices == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize(
    ("device", "dp", "gpus", "tp", "want"),
    [
        ("auto", 2, 4, 2, ["cuda:0", "cuda:2"]),  # each executor's group: two GPUs
        ("cuda:4", 2, 8, 2, ["cuda:4", "cuda:6"]),
        ("auto", 1, 2, 2, ["cuda:0"]),
    ],
)
def test_tensor_parallel_executors_take_whole_groups_of_gpus(
    device: str, dp: int, gpus: int, tp: int, want: list[str]
) -> None:
    assert launcher.executor_devices(device, dp, gpus, tp) == want


def test_tp_size_needs_its_gpus_and_passes_each_group_its_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "_gpu_count", lambda device: 2)
    with pytest.raises(SystemExit):
        launcher.parse_args(["--tp-size", "4"])
    assert "--tp-size 4 needs 4 GPUs; this machine has 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # two groups of two on two GPUs: they would share them
        launcher.parse_args(["--tp-size", "2", "--dp-size", "2"])
    assert "would share a GPU" in capsys.readouterr().err
    a = launcher.parse_args(["--tp-size", "2"])
    (executor,) = [s for s in launcher.child_specs(a) if s.service == "executor"]
    assert executor.argv[-3:] == ["executor", "--device", "cuda:0"]
