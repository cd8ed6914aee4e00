"""Finding the compiled extension: ahead of time (`cuda_ext._C`, built by `pip install`), else
JIT-compiled into a cache directory, else none (the NumPy reference decodes). Which path is live,
and why, is logged once and reported by cuda_ext.available()."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("wcodec.cuda_ext")
CSRC = Path(__file__).parent / "csrc"
CPU_SOURCES = tuple(sorted(p.name for p in CSRC.glob("*.cpp")))    # every .cpp and .cu of csrc/, as setup.py
CUDA_SOURCES = tuple(sorted(p.name for p in CSRC.glob("*.cu")))
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0;10.0;12.0"     # A100, RTX 30xx, RTX 40xx/L4, Hopper, B200, RTX 5090
CXX_FLAGS = ["-O3", "-fopenmp",                       # at::parallel_for is OpenMP: without it, serial
             "-ffp-contract=off"]                     # no FMA: gguf_blocks.h repeats gguf's float32 steps


@dataclass(frozen=True)
class Availability:
    cpp: bool                 # the C++ CPU twin is registered
    cuda: bool                # the CUDA kernels are registered and a GPU is visible
    path: str                 # "aot", "jit" or "numpy"
    reason: str


def cuda_buildable() -> bool:
    return torch.version.cuda is not None and shutil.which("nvcc") is not None \
        and bool(CUDA_SOURCES)


NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]


def _cache_dir(with_cuda: bool) -> Path:
    """The build's directory: named by its sources, flags, arch list and torch, so that a library
    found there is the build of exactly these (`_jit` loads it without asking ninja)."""
    digest = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir()):
        digest.update(name.encode() + (CSRC / name).read_bytes())
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    # "checked": a build from before _check_shared_runtime (2026-12-02) may carry its own libstdc++,
    # so it is not loaded again
    digest.update(f"{torch.__version__}|{with_cuda}|{CXX_FLAGS}|{NVCC_FLAGS}|{arch}|checked".encode())
    root = Path(os.environ.get("WCODEC_EXT_CACHE", Path.home() / ".cache" / "wcodec"))
    return root / f"ext-{digest.hexdigest()[:16]}"


def _jit(with_cuda: bool) -> None:
    """Load the JIT build in the cache directory, building it first if it is not there. A library
    already built is loaded directly: torch's `load` would import its build tools and run ninja to
    find it up to date, about a second of a server's start that the GIL shares with its imports."""
    name = "wcodec_ext_cuda" if with_cuda else "wcodec_ext"
    build_dir = _cache_dir(with_cuda)
    built = build_dir / f"{name}.so"
    if built.exists():
        try:
            torch.ops.load_library(str(built))
            return
        except OSError:                      # half written (a build interrupted): build it again
            log.warning("the JIT build in %s does not load; building it again", build_dir)
    from torch.utils.cpp_extension import get_cxx_compiler, load
    _check_shared_runtime(get_cxx_compiler())
    sources = [str(CSRC / s) for s in CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())]
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    load(name=name, sources=sources, build_directory=str(build_dir), extra_cflags=CXX_FLAGS + ["-march=native"],
         extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], extra_cuda_cflags=NVCC_FLAGS,
         with_cuda=with_cuda, is_python_module=False, verbose=False)


def _check_shared_runtime(cxx: str) -> None:
    """Refuse a C++ compiler that links libstdc++ into the library statically: the library then
    throws through a C++ runtime of its own, and every TORCH_CHECK with a formatted message (a
    std::string handed to torch's c10::Error) crashed the process (SIGSEGV) instead of raising. The
    lent H200s' `c++` (/opt/gcc's wrapper) does so; their /usr/bin/g++ does not (2026-12-02)."""
    import subprocess
    import tempfile
    if shutil.which("ldd") is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.so"
        try:
            subprocess.run([cxx, "-shared", "-fPIC", "-x", "c++", "-", "-o", str(probe)], check=True, capture_output=True,
                           input=b"#include <string>\nstd::string wcodec_probe(int n) { return std::to_string(n); }\n",
                           timeout=60)
            needed = subprocess.run(["ldd", str(probe)], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return                                       # the build itself will say what is wrong
    if "libstdc++" not in needed:
        raise RuntimeError(f"the C++ compiler {cxx!r} links libstdc++ statically, so the extension's errors would "
                           "crash the process; set CXX to one that links it as a shared library (e.g. /usr/bin/g++)")


def _has_cuda_kernel() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("wcodec::decode_pieces", "CUDA")


_LOAD_LOCK = threading.Lock()


def ensure_loaded() -> Availability:
    """Load the extension once: AOT module, else JIT (unless WCODEC_NO_JIT=1), else NumPy. Thread
    safe: an early load and the start-up warm-up may ask at the same time."""
    with _LOAD_LOCK:
        return _load()


@lru_cache(maxsize=1)
def _load() -> Availability:
    path, reason = "numpy", ""
    try:
        import cuda_ext._C  # noqa: F401  (registers the ops)
        path, reason = "aot", "prebuilt cuda_ext._C"
    except ImportError as e:
        reason = f"no prebuilt module ({e})"
        if os.environ.get("WCODEC_NO_JIT") != "1":
            try:
                _jit(cuda_buildable())
                path, reason = "jit", f"JIT-built in {_cache_dir(cuda_buildable())}"
            except Exception as e:          # a missing compiler must not break decoding
                reason += f"; JIT build failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    cpp = path != "numpy"
    cuda = cpp and _has_cuda_kernel() and torch.cuda.is_available()
    if cpp:
        from . import ops
        ops.register_fakes()
    avail = Availability(cpp, cuda, path, reason + ("" if cuda else "; CUDA kernels: "
                         + ("no GPU visible" if cpp and _has_cuda_kernel() else "not built")))
    log.info("wcodec decoder: %s (%s)", path, avail.reason)
    return avail
