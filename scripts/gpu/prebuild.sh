#!/usr/bin/env bash
# Build the CUDA extension HERE (nvcc compiles, it cannot run) for the lent box's torch, so that a
# call there loads it instead of spending 45-70 s of device time on the JIT build. The result is
# .extbuild/ (carry it): the library and the JIT cache directory the box would have built it in
# (cuda_ext/build.py's _cache_dir, computed for the box's torch and arch list); env.sh puts it there.
# If the sources change after this, the directory's name no longer matches and the box JIT-builds.
#   TORCH_WHEEL=<the box's torch wheel, unpacked: a folder holding torch/include and torch/lib>
#   TORCH_VERSION (default 2.11.0+cu130), ARCH (default 9.0a; written to .extbuild/arch, which env.sh exports)
# Usage (repo root, here): TORCH_WHEEL=/tmp/t211 bash scripts/gpu/prebuild.sh
set -euo pipefail
T=${TORCH_WHEEL:?unpack the box torch wheel (pip download torch==2.11.0 --no-deps) and name its folder}/torch
ARCH=${ARCH:-9.0a}; VERSION=${TORCH_VERSION:-2.11.0+cu130}; NAME=wcodec_ext_cuda
CUDA=${CUDA_HOME:-/usr/local/cuda}
OUTD=.extbuild; OBJ=.extobj; mkdir -p "$OUTD" "$OBJ"     # objects stay here: a rebuild compiles what changed
exclude="$(git rev-parse --git-path info/exclude)"; for d in "/$OUTD/" "/$OBJ/"; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
read -r CXX_FLAGS NVCC_FLAGS CPU_SRC CUDA_SRC TARGET < <(python - "$VERSION" "$ARCH" <<'EOF'
import os, sys
os.environ.update(TORCH_CUDA_ARCH_LIST=sys.argv[2], WCODEC_EXT_CACHE="/tmp/wcodec-ext")   # env.sh's
import cuda_ext.build as b
b.torch.__version__ = sys.argv[1]
j = lambda xs: ",".join(xs)
print(j(b.CXX_FLAGS), j(b.NVCC_FLAGS), j(b.CPU_SOURCES), j(b.CUDA_SOURCES), b._cache_dir(True))
EOF
)
INC="-Icuda_ext/csrc -isystem $T/include -isystem $T/include/torch/csrc/api/include -isystem $CUDA/include"
DEFS="-DTORCH_EXTENSION_NAME=$NAME -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1"
SM=${ARCH/./}
jobs=()
deps() { local f=$1 h; echo "$f"; for h in $(sed -n 's/^#include "\(.*\)"/\1/p' "$f"); do deps "cuda_ext/csrc/$h"; done; }
stale() { [ ! -f "$OBJ/$1.o" ] || [ -n "$(find $(deps "cuda_ext/csrc/$1" | sort -u) -newer "$OBJ/$1.o")" ]; }
for s in ${CPU_SRC//,/ }; do
  stale "$s" && jobs+=("c++ $DEFS $INC -fPIC -std=c++17 ${CXX_FLAGS//,/ } -march=native -c cuda_ext/csrc/$s -o $OBJ/$s.o")
done
for s in ${CUDA_SRC//,/ }; do
  stale "$s" && jobs+=("nvcc $DEFS $INC -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
-D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -gencode=arch=compute_$SM,code=sm_$SM --compiler-options -fPIC \
${NVCC_FLAGS//,/ } -std=c++17 -c cuda_ext/csrc/$s -o $OBJ/$s.o")
done
[ ${#jobs[@]} -eq 0 ] || printf '%s\n' "${jobs[@]}" | xargs -P "$(nproc)" -I{} sh -c '{}'
c++ "$OBJ"/*.o -shared -fopenmp -L"$T/lib" -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -ltorch -L"$CUDA/lib64" -lcudart \
  -o "$OUTD/$NAME.so"
echo "$TARGET" > "$OUTD/target"; echo "$ARCH" > "$OUTD/arch"
echo "built $OUTD/$NAME.so for $VERSION sm_$SM; the box loads it from $TARGET"
