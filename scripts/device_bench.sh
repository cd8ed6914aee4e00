#!/usr/bin/env bash
# The GPU benchmark call: build, profile one decode (ncu + SASS), then bench/gpu_bench.py with the
# peers. Carry .whl (dfloat11, dahuffman) and .whlnv (nvCOMP). Logs and JSON under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} WCODEC_EXT_CACHE=${WCODEC_EXT_CACHE:-/tmp/wcodec-ext}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
stage() { local t0=$SECONDS; echo "== $1"; shift; "$@"; echo "   ($((SECONDS - t0))s, rc=$?)"; }
stage build timeout 300 python3 -c "import cuda_ext; print(cuda_ext.available())"
so=$(ls $WCODEC_EXT_CACHE/*/wcodec_ext_cuda.so | head -1)
cuobjdump -sass "$so" > "$OUT/decode_float.sass" 2>&1
echo "SASS lines: $(wc -l < "$OUT/decode_float.sass")"
stage ncu timeout 200 ncu --clock-control none -k regex:decode_kernel --launch-count 1 --section SpeedOfLight \
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
  python3 bench/quick_cuda.py 256 > "$OUT/ncu.txt" 2>&1
grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Issued Warp Per|Stall|Warp Cycles Per Issued|Registers|Shared Memory Config|Block Limit" "$OUT/ncu.txt" | head -30
stage bench timeout ${BENCH_TIMEOUT:-500} python3 bench/fine_decode.py --layers 6 --model-layers 32 --json "$OUT/fine_decode.json"
