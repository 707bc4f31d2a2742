#!/usr/bin/env bash
# Regenerates the Python stubs of radixserve's own gRPC API (shared/grpc_api/radixserve.proto),
# which are committed; tests/shared/test_grpc_api.py fails when they fall out of step.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  shared/grpc_api/radixserve.proto
