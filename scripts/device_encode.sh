#!/usr/bin/env bash
# One call on a lent GPU for the encoder (issue 25): build the encoder ops alone, the GPU tests
# (tests/gpu/test_encode_gpu.py; carried .encfiles/: a demo GGUF subset and a MiniLM subset),
# compute-sanitizer memcheck, the throughput bench and the 7B-shaped model file to file. Logs in $OUT.
#   bash scripts/device_encode.sh        (repo root; carry .whl and .encfiles)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export WCODEC_NO_JIT=1 WCODEC_ENCODER_ONLY=1 WCODEC_ENCODE_FILES=$PWD/.encfiles
LIMIT=${LIMIT:-560}
left() { local rest=$((LIMIT - SECONDS)); echo $(( rest < $1 ? rest : $1 )); }
stage build timeout "$(left 150)" python3 scripts/encoder_ext.py
stage tests timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_encode_gpu.py -rA -s \
  > "$OUT/encode_tests.log" 2>&1; grep -E "passed|failed|sha256|Error" "$OUT/encode_tests.log" | tail -12
stage sanitize timeout "$(left 90)" compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 scripts/sanitize_encode.py > "$OUT/sanitizer.log" 2>&1; grep -E "ERROR SUMMARY|sanitize encode" "$OUT/sanitizer.log"
stage bench timeout "$(left 120)" python3 bench/encode_speed.py .encfiles/minilm --encoder-only --repeat 3 --gpu-layers 8 > "$OUT/encode_speed.log" 2>&1
cat "$OUT/encode_speed.log" | tail -12
stage 7b timeout "$(left 150)" python3 bench/seven_b_encode.py /tmp/seven_b --encoder-only --device cuda \
  > "$OUT/seven_b.log" 2>&1; tail -5 "$OUT/seven_b.log"
