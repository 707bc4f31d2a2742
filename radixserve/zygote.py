"""The zygote of `radixserve serve`: one process that imports every service's modules once,
then forks each service from that state.

A service spends most of its start importing (torch, transformers, xgrammar, aiohttp: about
4.5 s of CPU for an executor or a grammar service, 1 s for the lighter ones), and it did so
again at every restart. Forked from here, a service skips that: a restart after a crash is
the service's own start-up only, and a whole stack imports once instead of six times.

Each service is forked twice (here, then from a short-lived intermediate that exits at once),
so that the kernel hands it to `radixserve serve`, a child subreaper (PR_SET_CHILD_SUBREAPER):
serve is its parent as if it had started it itself, reaps it, reads its exit code and sends it
its signals; its parent-death signal is set once it is serve's, so it dies with serve; and
the zygote's own death leaves the running services alone. Its process title becomes the
command it stands for (`python -m radixserve tokenizer ...`), as `ps` and `pgrep -f` expect.

Nothing here may start a thread, touch CUDA or open a connection before forking: a forked
service must find the state of a process that has only imported. Two imports would: numpy
starts OpenBLAS's thread pool (OPENBLAS_NUM_THREADS=1 here: the services' numpy does no
matrix products worth threads; torch's own run on MKL and OpenMP), and tvm_ffi (through
xgrammar) asks torch whether CUDA is available, which starts the CUDA driver (a thread) and
makes every CUDA call of a forked process fail ("Cannot re-initialize CUDA in forked
subprocess"). So tvm_ffi imports here with its torch hooks off
(TVM_FFI_DISABLE_TORCH_C_DLPACK=1), and each forked service runs them as its import would
have. After importing, the zygote checks that it still has one thread and that a fork is not
one torch would refuse CUDA in; if either fails, it forks nothing, and serve starts every
service from its command as before (saying why once).

The model's GGUF file, when it is one, is parsed here too: the gguf package reads every
metadata array element by element (4 s of CPU for the default model's vocabulary), and the
tokenizer, grammar and executor processes each read it; forked, they find it parsed.

Protocol, over the socket serve passes as argv[1]: one JSON line per service to start,
{"argv": [...], "env": {...}}; the answer is one line, {"pid": N}; {"error": "..."} when no
process could be forked (serve then starts that service itself); or {"refuse": "..."} when
forking is not safe here (serve then starts every service itself).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import BinaryIO

# What serve's children import: `radixserve <service>` runs these modules' main().
PRELOAD = (
    "services.executor.main",
    "services.grammar.main",
    "services.tokenizer.main",
    "services.detokenizer.main",
    "services.gateway.main",
    "services.scheduler.main",
)
ADOPTION_TIMEOUT_S = 10.0
TVM_FFI_HOOKS_OFF = "TVM_FFI_DISABLE_TORCH_C_DLPACK"


@dataclass(frozen=True)
class Request:
    argv: list[str]  # [python, "-m", "radixserve", service, *flags]
    env: dict[str, str]


def main() -> None:
    from radixserve.children import arm_parent_death

    arm_parent_death()  # first: see radixserve.children.spawn
    sock = socket.socket(fileno=int(sys.argv[1]))
    serve_pid = os.getppid()
    # Ctrl-C in a terminal reaches the whole process group; serve stops the services and
    # then closes the socket, which ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault(TVM_FFI_HOOKS_OFF, "1")
    for module in PRELOAD:
        # One that fails to import fails again in the service, which reports it as it would
        # without the zygote.
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    with contextlib.suppress(Exception):  # the services report a model they cannot read
        _parse_model()
    with contextlib.suppress(ImportError):
        import setproctitle  # noqa: F401 - imported once here rather than in every service
    request = _serve(sock, serve_pid, _unsafe())  # returns only in a forked service
    _become(request, serve_pid)
    from radixserve.cli import main as cli_main
    from radixserve.teardown import exit_without_teardown

    cli_main(request.argv[3:])
    # It carries every module imported here, triton's among them (radixserve/teardown.py)
    exit_without_teardown()


def _parse_model() -> None:
    """Parse the served model's GGUF file into shared.model_files' per-process cache."""
    from shared.model_files import gguf_reader, resolve_model

    env = os.environ
    model, name = env.get("RADIXSERVE_MODEL", ""), env.get("RADIXSERVE_SERVED_MODEL_NAME", "")
    source = resolve_model(model, name)
    if source.kind == "gguf":
        gguf_reader(source.path)


def _unsafe() -> str | None:
    """Why forking from this process is not safe, or None."""
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        return f"the zygote has {threads} threads after importing"
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    # torch marks a fork "bad" once this process asked CUDA anything (the check itself asks
    # nothing: it reads the flag torch's fork handler set)
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return "importing the services initialised CUDA in the zygote"
    return None


def _serve(sock: socket.socket, serve_pid: int, unsafe: str | None) -> Request:
    """Answer requests until serve closes the socket (then exit); return in each service."""
    reader = sock.makefile("rb")
    for line in reader:
        if unsafe is not None:
            sock.sendall(json.dumps({"refuse": unsafe}).encode() + b"\n")
            continue
        raw = json.loads(line)
        request = Request(list(raw["argv"]), dict(raw["env"]))
        try:
            pid = _fork_adopted(reader, sock)
        except OSError as e:  # out of processes or memory: serve starts this one itself
            sock.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
            continue
        if pid == 0:
            return request
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    raise SystemExit(0)


def _fork_adopted(reader: BinaryIO, sock: socket.socket) -> int:
    """Fork a service through an intermediate that exits at once, so that it is orphaned and
    adopted by serve; its pid here, 0 in the service itself."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        pid = -1
        try:
            os.close(r)
            pid = os.fork()
            if pid > 0:
                os.write(w, str(pid).encode())
        finally:
            if pid != 0:
                os._exit(0)  # the intermediate, whatever happened: never back to the loop
        os.close(w)
        reader.close()
        sock.close()
        return 0
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    os.waitpid(intermediate, 0)
    if not data:
        raise OSError("the intermediate could not fork")
    return int(data)


def _become(request: Request, serve_pid: int) -> None:
    """Turn this fork into the process `request.argv` would have started."""
    # Adopted by serve once the intermediate has exited, which it does right after forking
    # this process: a moment's wait (ADOPTION_TIMEOUT_S bounds a serve that could not be
    # made a subreaper, whose orphans go to init instead).
    deadline = time.monotonic() + ADOPTION_TIMEOUT_S
    while os.getppid() != serve_pid:
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.001)
    from radixserve.children import die_with

    die_with(serve_pid)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # The title first: setproctitle makes room for it by moving the environment strings,
    # which it can only find before os.environ is rewritten.
    _set_title(" ".join(request.argv))
    os.environ.clear()
    os.environ.update(request.env)
    sys.argv = [request.argv[0], *request.argv[3:]]
    if "numpy" in sys.modules:  # its global generator was seeded once, here; a fresh one each
        sys.modules["numpy"].random.seed()
    hooks = sys.modules.get("tvm_ffi._optional_torch_c_dlpack")
    if hooks is not None and os.environ.get(TVM_FFI_HOOKS_OFF, "0") == "0":
        # What tvm_ffi's import skipped in the zygote (its module-level code, run here)
        with contextlib.suppress(Exception):
            hooks._LIB = hooks.load_torch_c_dlpack_extension()  # type: ignore[attr-defined]
            hooks.patch_torch_cuda_stream_protocol()


def _set_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:  # a dependency; without it `ps` shows the zygote's command
        return
    setproctitle.setproctitle(title)


if __name__ == "__main__":
    main()
