"""`radixserve serve --tp-size 2` on the CPU (gloo): the executor's model split over two
processes answers what one process answers, and a rank that dies takes its group down, after
which the supervisor restarts the group and it serves again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import Stack, start_stack
from tests.e2e.test_control_endpoints import get, post

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PROMPTS = ["the thin cat sat", "a b c d e f g", "once"]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tp_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(
        ["--model", str(tiny_model_dir), "--tp-size", "2", "--max-total-tokens", "8192"],
        tmp_path_factory.mktemp("tp") / "tp-stack.log",
        redis_url=None,  # a private Redis
    )
    yield stack
    code = stack.stop()
    assert code == 0, f"serve exited with {code} on Ctrl-C\n{stack.log_tail()}"


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if ppid == pid:
            out.append((int(entry), cmd))
    return out


def rank_processes(stack: Stack) -> list[int]:
    executors = [p for p, cmd in children(stack.proc.pid) if "radixserve executor" in cmd]
    return [p for e in executors for p, cmd in children(e) if "distributed.rank" in cmd]


def answers(stack: Stack) -> list[dict[str, Any]]:
    out = []
    for text in PROMPTS:
        status, body = post(stack, "/generate", {"text": text, "sampling_params": GREEDY})
        assert status == 200, body
        out.append(body)
    return out


def test_two_ranks_answer_what_one_answers(tp_stack: Stack, tiny_stack: Stack) -> None:
    got, want = answers(tp_stack), answers(tiny_stack)
    assert [a["output_ids"] for a in got] == [a["output_ids"] for a in want]
    assert [a["text"] for a in got] == [a["text"] for a in want]
    # the prefix cache works across the group: the same prompt again reuses it
    again = answers(tp_stack)
    assert all(a["meta_info"]["cached_tokens"] > 0 for a in again)
    assert [a["output_ids"] for a in again] == [a["output_ids"] for a in want]
    assert len(rank_processes(tp_stack)) == 1
    status, info = get(tp_stack, "/get_server_info")
    assert status == 200 and [e["tp_size"] for e in info["executors"]] == [2]


def test_a_dead_rank_takes_the_group_down_and_it_comes_back(
    tp_stack: Stack, tiny_stack: Stack
) -> None:
    (rank1,) = rank_processes(tp_stack)
    os.kill(rank1, signal.SIGKILL)
    deadline = time.monotonic() + 120
    log = tp_stack.log_path
    while "the group is broken" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, tp_stack.log_tail()
        time.sleep(0.2)
    while not (
        (ranks := rank_processes(tp_stack))
        and ranks != [rank1]
        and post(tp_stack, "/health_generate", {})[0] == 200
    ):
        assert time.monotonic() < deadline, tp_stack.log_tail()
        time.sleep(0.5)
    assert "exited with code 3; restarting it" in log.read_text(errors="replace")
    assert [a["output_ids"] for a in answers(tp_stack)] == [
        a["output_ids"] for a in answers(tiny_stack)
    ]


def test_a_group_over_two_nodes(
    tiny_model_dir: Path, tiny_stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--nnodes 2 on one machine: node 1's process (`radixserve executor --node-rank 1`, no
    bus) joins node 0's rank 0 at --dist-init-addr; the stack serves what one executor does,
    and node 1's rank leaves when the stack stops."""
    import subprocess
    import sys

    from tests.conftest import free_port

    addr = f"127.0.0.1:{free_port()}"
    group = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    logs = tmp_path_factory.mktemp("two-nodes")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    node1_log = open(logs / "node1.log", "wb")  # noqa: SIM115 - the child writes it
    node1 = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "executor", "--model", str(tiny_model_dir),
         "--device", "cpu", "--max-total-tokens", "8192", *group, "--node-rank", "1"],
        stdout=node1_log,
        stderr=subprocess.STDOUT,
        env=env,
    )  # fmt: skip
    try:
        stack = start_stack(
            ["--model", str(tiny_model_dir), "--max-total-tokens", "8192", *group,
             "--node-rank", "0"],
            logs / "node0.log",
            redis_url=None,
        )  # fmt: skip
        try:
            assert [a["output_ids"] for a in answers(stack)] == [
                a["output_ids"] for a in answers(tiny_stack)
            ]
            assert rank_processes(stack) == []  # node 0 has no other rank: node 1 has it
        finally:
            assert stack.stop() == 0, stack.log_tail()
        assert node1.wait(60) == 0, (logs / "node1.log").read_text(errors="replace")[-3000:]
        assert "rank 0 stopped" in (logs / "node1.log").read_text(errors="replace")
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
