#!/usr/bin/env bash
# What scripts/device_coldstart.sh needs on the GPU box (no network there), made here:
#   .whlsvc/            the service's wheels for CPython 3.12 (and accelerate, used only if absent there)
#   .coldstart/tokenizer the demo model's tokenizer files (the 7B-shaped model borrows them)
set -euo pipefail
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
mkdir -p .whlsvc/optional .coldstart/tokenizer
python -m pip download -q $PLAT -d .whlsvc fastapi uvicorn pydantic-settings prometheus-client httpx xxhash
python -m pip download -q --no-deps $PLAT -d .whlsvc/optional accelerate psutil
PYTHONPATH=. python scripts/demo_tokenizer.py .coldstart/tokenizer
du -sh .whlsvc .coldstart
