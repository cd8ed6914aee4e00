#!/usr/bin/env bash
# One call on a lent GPU: install carried wheels, build the extension, run tests/gpu, the sanitizer
# and a timing; each stage time-boxed, full logs under $OUT.
# Usage (repo root, device machine): bash scripts/device_check.sh [demo-part.gguf,...]
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} WCODEC_EXT_CACHE=${WCODEC_EXT_CACHE:-/tmp/wcodec-ext}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
if ls .whl*/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
stage() { local t0=$SECONDS; echo "== $1"; shift; "$@"; echo "   ($((SECONDS - t0))s, rc=$?)"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
stage build timeout 300 python3 -c "import logging; logging.basicConfig(level=logging.INFO); import cuda_ext; print(cuda_ext.available())"
export WCODEC_DEMO_GGUF=${1:-}
stage gpu-tests timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu -rA --timeout 240 > "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|PASSED|FAILED|ERROR|demo part" "$OUT/gpu_tests.log" | tail -25
stage sanitizer timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_sample.py > "$OUT/sanitizer.log" 2>&1
grep -E "ERROR SUMMARY|sample decode|Error|error" "$OUT/sanitizer.log" | tail -8
stage quick timeout 240 python3 bench/quick_cuda.py ${ENTRY_STEPS:-256}
