#!/usr/bin/env bash
# The test command: lint, types, then every test (Redis is started by the test fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
# pytest exits 5 when no test ran; that fails this script like any other failure.
python3 -m pytest -q -p no:cacheprovider "$@"
