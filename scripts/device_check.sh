#!/usr/bin/env bash
# One call on a lent GPU: install carried wheels, build the extension, run tests/gpu, the sanitizer
# and a timing. Usage (from the repo root on the device machine): bash scripts/device_check.sh [demo.gguf,...]
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} WCODEC_EXT_CACHE=${WCODEC_EXT_CACHE:-/tmp/wcodec-ext}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl*/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
t0=$(date +%s)
python3 -c "import logging; logging.basicConfig(level=logging.INFO); import cuda_ext; print(cuda_ext.available())" 2>&1 | tail -3
echo "build: $(( $(date +%s) - t0 ))s"
export WCODEC_DEMO_GGUF=${1:-}
python3 -m pytest -q -p no:cacheprovider tests/gpu -rA --timeout 300 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_sample.py 2>&1 | tee "$OUT/sanitizer.log" | tail -6
python3 bench/quick_cuda.py 2 2>&1 | tee "$OUT/quick.log"
