#!/usr/bin/env bash
# The test command: lint, then the tests with the type check and every kernel's sm_90 compile
# beside them (Redis is started by the test fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
# One OpenMP thread a process. The test workers (and the services of the stacks they start)
# fill the two cores between them; with torch's default of a thread per core, each
# process's idle OpenMP threads spin waiting for work the other processes' cores are busy
# with. Measured on the 2-core CI machine: the executor, model and kernel tests took 256
# CPU-seconds with the default against 176 with one thread, and 181 s of wall time against 131.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Every kernel compiled for an sm_90 GPU on this machine without one
# (tests/kernels/native_compile.py): about 150 CPU-seconds of Triton's compiler, started
# first at the lowest priority so that it runs in what the rest leaves idle (the test workers
# wait on their stacks' processes much of the time). Its result is checked at the end.
compile_log=$(mktemp)
compile_cache=$(mktemp -d)
env -u TRITON_INTERPRET TRITON_CACHE_DIR="$compile_cache" \
  nice -n 19 python3 -m tests.kernels.native_compile >"$compile_log" 2>&1 &
compile_pid=$!
# mypy (about 45 s of one core in a fresh clone) beside them too, at the same low priority;
# its result is checked at the end with the compile's.
mypy_log=$(mktemp)
nice -n 19 mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$compile_pid" "$mypy_pid" 2>/dev/null || true; rm -rf "$compile_log" "$compile_cache" "$mypy_log"' EXIT
ruff check .
ruff format --check .
# pytest exits 5 when no test ran (with workers too); that fails this script like any other
# failure. Three workers on the two cores, each test file on one of them, and the files of
# the session-wide tiny stack together (tests/conftest.py groups them). A test that starts a
# stack waits on its processes, a fault test on a timeout, much of the time: with two
# workers the tests took 2,100 s of wall time for 1,520 s of CPU (theirs and their stacks'),
# and a third worker's tests fill those waits (the cores were idle 1 s of a 12-minute run).
# Each worker has its own redis-server.
# tests/kernels/test_native_compile.py leaves the compile above to this script
# (RADIXSERVE_NATIVE_COMPILE_BESIDE).
RADIXSERVE_NATIVE_COMPILE_BESIDE=1 \
  python3 -m pytest -q -p no:cacheprovider -n 3 --dist loadgroup "$@"
if ! wait "$mypy_pid"; then
  echo "FAILED: mypy"
  cat "$mypy_log"
  exit 1
fi
tail -n 1 "$mypy_log"
if ! wait "$compile_pid"; then
  echo "FAILED: the sm_90 compile of kernels/ (python -m tests.kernels.native_compile):"
  grep -v '^ok ' "$compile_log"
  exit 1
fi
tail -n 1 "$compile_log"
