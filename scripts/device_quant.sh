#!/usr/bin/env bash
# One call on a lent GPU for the quantized codecs: build the extension, their GPU tests, the
# sanitizer run and the timing; each stage time-boxed, full logs under $OUT.
# Usage (repo root, device machine): bash scripts/device_quant.sh [demo-part.gguf]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PART=${1:-}
stage build timeout 420 python3 -c "import logging; logging.basicConfig(level=logging.INFO); import cuda_ext; print(cuda_ext.available())"
stage gpu-tests timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_cuda.py tests/gpu/test_quant_fuzz.py -rA --timeout 240 > "$OUT/quant_gpu_tests.log" 2>&1
grep -E "passed|failed|PASSED|FAILED|ERROR" "$OUT/quant_gpu_tests.log" | tail -30
stage sanitizer timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_quant.py > "$OUT/quant_sanitizer.log" 2>&1
grep -E "ERROR SUMMARY|quantized kernels|Error|error" "$OUT/quant_sanitizer.log" | tail -8
stage bench timeout 480 python3 bench/quant_gpu.py ${PART:+--part "$PART"} --json "$OUT/quant_gpu.json"
