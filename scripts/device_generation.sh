#!/usr/bin/env bash
# Issue 13 on a lent GPU: a Llama-2-7B-shaped model served with continuous batching, tokens/s at
# 64 concurrent clients against 1 (bench/generation_gpu.py through loadtests/run.py).
# Made here first: bash scripts/generation_carry.sh   (carry .whlgen and .gentok)
# Usage: bash scripts/device_generation.sh [--users 64 --duration 60 --tokens 48]
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} WCODEC_EXT_CACHE=${WCODEC_EXT_CACHE:-/tmp/wcodec-ext}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whlgen/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
uptime; python3 -V; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python3 -c "import cuda_ext; print(cuda_ext.available())" || exit 1       # builds the extension (not timed)
timeout 570 python3 bench/generation_gpu.py --tokenizer .gentok --out "$OUT" "$@" 2>&1 | tee "$OUT/generation_gpu.log"
