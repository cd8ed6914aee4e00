#!/usr/bin/env bash
# One call on a lent GPU for the fixed-rate form (issue 24): build, tests/gpu/test_fixedrate_cuda.py,
# the sanitizer, bench/fixedrate_gpu.py. Usage (repo root, device machine): bash scripts/device_fixedrate.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export MAX_JOBS=16
stage build timeout 200 python3 -c "import cuda_ext; print(cuda_ext.available())"
stage bench timeout 90 python3 bench/fixedrate_gpu.py --json "$OUT/fixedrate_gpu.json" 2>&1 | tee "$OUT/bench.log"
stage gpu-tests timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fixedrate_cuda.py > "$OUT/gpu_tests.log" 2>&1
tail -15 "$OUT/gpu_tests.log"
stage sanitizer timeout 80 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_fixedrate.py > "$OUT/sanitizer.log" 2>&1
grep -E "ERROR SUMMARY|sample|Error" "$OUT/sanitizer.log" | tail -8
