# Sourced by scripts/gpu/run.sh on a lent GPU (repo root): environment, carried wheels (.whl*/
# folders, installed to /tmp/site once per machine), $OUT, and `stage NAME CMD...` (timed, with its rc).
[ -f .extbuild/arch ] && : "${TORCH_CUDA_ARCH_LIST:=$(cat .extbuild/arch)}"   # the carried build's arch: its directory's name holds it
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} WCODEC_EXT_CACHE=${WCODEC_EXT_CACHE:-/tmp/wcodec-ext}
# The lent boxes set CXX to /opt/gcc/bin/g++, which links libstdc++ statically: cuda_ext/build.py refuses
# it (the library's errors crashed the process). Their /usr/bin/g++ links it as a shared library.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
if ls .whl*/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
if [ -f .extbuild/target ]; then              # built here by scripts/gpu/prebuild.sh: no JIT build on the box
  T_EXT=$(cat .extbuild/target); mkdir -p "$T_EXT"          # replaced when it differs: a warm box may hold another build
  cmp -s .extbuild/wcodec_ext_cuda.so "$T_EXT/wcodec_ext_cuda.so" || cp .extbuild/wcodec_ext_cuda.so "$T_EXT/"
  want=$(python3 -c "import cuda_ext.build as b; print(b._cache_dir(True))" 2>/dev/null)   # sources edited since the prebuild?
  [ "$want" = "$T_EXT" ] || echo "env.sh: .extbuild is a build of other sources or flags ($T_EXT; these sources want" \
    "${want:-?}): rerun scripts/gpu/prebuild.sh here, or the first import JIT-builds (45-70 s) and a swapped-in library is not the one loaded" >&2
fi
stage() { local t0=$SECONDS; echo "== $1"; shift; "$@"; local rc=$?; echo "   ($((SECONDS - t0))s, rc=$rc)"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
