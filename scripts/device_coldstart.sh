#!/usr/bin/env bash
# Issue 9 on a lent GPU: process start -> first token, `wcodec serve` against transformers, for a
# Llama-2-7B-shaped bf16 model (bench/cold_start.py; built once into /tmp/wcodec-coldstart).
# Carry .whlsvc (the service's cp312 wheels) and .coldstart (tokenizer files): scripts/coldstart_carry.sh.
# server: a load into a running server against load_file, then model switches from the host cache.
# Usage: bash scripts/device_coldstart.sh warm|cold|server[,...]  (parts that fit one call's 10 min;
#        a later call on the still-warm machine reuses /tmp/wcodec-coldstart)
set -uo pipefail
PART=${1:-warm}
TAG=${PART//,/-}                         # warm,server -> warm-server (names that come back)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} WCODEC_EXT_CACHE=${WCODEC_EXT_CACHE:-/tmp/wcodec-ext}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whlsvc/*.whl || exit 1
python3 -c "import accelerate" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-cache-dir \
  --target /tmp/site .whlsvc/optional/*.whl       # transformers' device_map="cuda" needs accelerate
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
uptime; df -h /tmp | tail -1; python3 -V
python3 -c "import cuda_ext; print(cuda_ext.available())" || exit 1       # builds the extension (not timed)
python3 -c "import kvikio" 2>/dev/null && echo "kvikio present" || echo "kvikio absent: no GPUDirect Storage"
timeout $((580 - SECONDS)) python3 bench/cold_start.py --make-7b --tokenizer .coldstart/tokenizer --device cuda --runs "${RUNS:-3}" \
  --warmup "${WARMUP:-1}" --cold drop --only "$PART" --json "$OUT/coldstart-$TAG.json" 2>&1 | tee "$OUT/coldstart-$TAG.log"
cp -r /tmp/wcodec-coldstart/logs "$OUT/logs-$TAG" 2>/dev/null
grep -h -A40 "start-up timeline" /tmp/wcodec-coldstart/logs/*ours_crc_on-0.log 2>/dev/null | head -45
