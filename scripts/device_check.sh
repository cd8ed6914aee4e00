#!/usr/bin/env bash
# One call on a lent GPU: install carried wheels, build the extension, run tests/gpu, the sanitizer
# and a timing; each stage time-boxed, full logs under $OUT.
# Usage (repo root, device machine): bash scripts/device_check.sh [demo-part.gguf,...]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
stage build timeout 300 python3 -c "import logging; logging.basicConfig(level=logging.INFO); import cuda_ext; print(cuda_ext.available())"
export WCODEC_DEMO_GGUF=${1:-}
stage gpu-tests timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu -rA --timeout 240 > "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|PASSED|FAILED|ERROR|demo part" "$OUT/gpu_tests.log" | tail -25
stage sanitizer timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_sample.py > "$OUT/sanitizer.log" 2>&1
grep -E "ERROR SUMMARY|sample decode|Error|error" "$OUT/sanitizer.log" | tail -8
stage quick timeout 240 python3 bench/quick_cuda.py ${ENTRY_STEPS:-256}
