#!/usr/bin/env bash
# The test command: lint, types, then every test (Redis is started by the test fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
# pytest exits 5 when no test ran (with workers too); that fails this script like any other
# failure. Two workers, each test file on one of them, and the files of the session-wide
# tiny stack together (tests/conftest.py groups them): a stack's start waits on its processes
# much of the time, which the other worker's tests fill. Each worker has its own redis-server.
python3 -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup "$@"
