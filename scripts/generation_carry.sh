#!/usr/bin/env bash
# What scripts/device_generation.sh needs on the GPU box (no network there), made here:
#   .whlgen/   the service's and the load script's wheels (locust, gevent, ...) for CPython 3.12
#   .gentok/   the demo model's tokenizer files (the 7B-shaped model uses its vocabulary)
set -euo pipefail
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
grep -qx '/.whlgen/' .git/info/exclude 2>/dev/null || printf '/.whlgen/\n/.gentok/\n' >> "$(git rev-parse --git-path info/exclude)"
mkdir -p .whlgen .gentok
python -m pip download -q $PLAT -d .whlgen fastapi uvicorn pydantic-settings prometheus-client httpx xxhash locust
PYTHONPATH=. python scripts/demo_tokenizer.py .gentok
du -sh .whlgen .gentok
