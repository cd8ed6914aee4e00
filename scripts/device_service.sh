#!/usr/bin/env bash
# The service on a lent GPU (carry .whlsvc: fastapi, pydantic, uvicorn, ... and gguf).
# Usage: bash scripts/device_service.sh 7b --part .demo/part1.gguf   |   demo --parts A,B,C
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} WCODEC_EXT_CACHE=${WCODEC_EXT_CACHE:-/tmp/wcodec-ext}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whlsvc/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import cuda_ext; print(cuda_ext.available())" || exit 1
python3 bench/service_gpu.py "$@"
