"""Work `wcodec compress` starts before torch imports, on threads of its own (`start`): the CUDA
context, and the archive file's page cache (codec/container.Prefill: zeros written into the file
the writer then writes over, the pages of a new file being the costly part of writing it).
`wcodec serve` may dlopen torch's libraries meanwhile (`torch_libraries`, codec/preload.py: the
import's own dlopen holds the GIL; WCODEC_EARLY_DLOPEN=torch); its CUDA context and page-locked
early reads are service/load/driver.py's.

`import torch` takes ~3 s on the H100 box and creating the CUDA context ~0.35 s after it. The
context is the device's primary context, which the CUDA runtime (torch's) retains when it first
needs the device; the driver API can create it earlier. So a thread loads libcuda and retains the
primary context of device 0 (the device `--device cuda` means) through ctypes, whose foreign calls
release the GIL: it runs beside the import instead of after it. It is an optimisation only: with
no driver or no device (this CPU machine) every failure is ignored, and torch later finds and
reports the same state itself. The reference retained is kept for the life of the process (a
release would destroy the context before torch retains it)."""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from codec.container import Prefill

LIBCUDA = "libcuda.so.1"
PREFILL_RATIO = 0.7        # of the source's bytes: a lossless bf16 archive is ~0.665 of its source
PREFILL_MIN_CPUS = 8       # the prefill takes a core beside the import: on 2 it slowed the command
TORCH_LIBRARIES = ("libc10.so", "libtorch_cpu.so")   # as _C's dependencies, after what follows
TORCH_GLOBAL_DEPS = "libtorch_global_deps.so"        # torch/__init__.py's first dlopen, RTLD_GLOBAL


def start(args: argparse.Namespace) -> Prefill | None:
    """Start the early work of a parsed `compress`: the CUDA context unless --device cpu, and the
    prefill of a lossless archive where there are PREFILL_MIN_CPUS (WCODEC_EARLY_CUDA=0: no early
    context; WCODEC_PREFILL=0 or 1: no prefill, or one anyway; to time both ways). Returns the
    prefill, which the caller hands to the writer or discards."""
    if args.device != "cpu" and os.environ.get("WCODEC_EARLY_CUDA") != "0":
        start_cuda_context()
    if not _prefill_wanted(args.codec, os.environ.get("WCODEC_PREFILL")):
        return None
    from codec.container import Prefill  # numpy's import: after the CUDA thread starts
    return Prefill(args.dst, int(PREFILL_RATIO * source_bytes(args.src)))


def _prefill_wanted(codec: str, flag: str | None) -> bool:
    if codec != "lossless" or flag == "0":
        return False
    return flag == "1" or len(os.sched_getaffinity(0)) >= PREFILL_MIN_CPUS


def source_bytes(src: str) -> int:
    """The bytes of a checkpoint's tensor files (0 where there are none to be seen)."""
    path = Path(src)
    try:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        return sum(f.stat().st_size for f in files)
    except OSError:
        return 0


def torch_libraries(environ=os.environ) -> list[tuple[Path, int]]:
    """(file, dlopen mode) of the libraries a thread may load ahead of `import torch`, exactly as
    the import would: the same files, in the same order, with the same flags, so that the
    import's own dlopens only count references (codec/preload.py). Found without importing torch.

    A CPU torch: libc10 and libtorch_cpu. A CUDA torch first loads libtorch_global_deps, then
    CUDA libraries of the pip wheels by path (torch/__init__.py's _preload_cuda_deps, whose list
    is read from that file), then _C and its dependencies (libtorch_cpu's own RPATH could find a
    CUDA library before torch's preload picks its file, so all of them are replayed). None where
    torch is not found, with TORCH_USE_RTLD_GLOBAL (torch then loads _C another way), or where
    torch's preload is not the one read here.

    Only with WCODEC_EARLY_DLOPEN=torch: on the 2-core CPU machine it gained nothing (the main
    thread's own dlopens before torch, pydantic_core's and numpy's, wait for the loader's lock
    while libtorch_cpu loads: 0.18 s more before the import, 0.16 s less in it); a CUDA torch's
    libraries, more and larger, are not yet timed on a GPU box."""
    folder = _torch_folder()
    if folder is None or environ.get("TORCH_USE_RTLD_GLOBAL") or environ.get("WCODEC_EARLY_DLOPEN") != "torch":
        return []
    local = os.RTLD_NOW | os.RTLD_LOCAL
    tail = [(folder / "lib" / name, local) for name in TORCH_LIBRARIES]
    if not all(path.is_file() for path, _ in tail):
        return []
    if not (folder / "lib" / "libtorch_cuda.so").is_file():
        return tail
    deps = _torch_cuda_deps(folder)
    if deps is None:
        return []
    return [(folder / "lib" / TORCH_GLOBAL_DEPS, os.RTLD_NOW | os.RTLD_GLOBAL), *((p, local) for p in deps), *tail]


def _torch_folder() -> Path | None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(folders[0]) if folders else None


_PRELOAD_LIST = re.compile(r"def _preload_cuda_deps\(.*?cuda_libs[^=]*=\s*\[(.*?)\]\s*\n(.*?)\n(?=\S)", re.DOTALL)
_PAIR = re.compile(r'\(\s*"([^"]+)",\s*"([^"]+)"\s*\)')
_OPTIONAL = re.compile(r'_preload_cuda_lib\(\s*"([^"]+)",\s*"([^"]+)",\s*required=False\s*\)')
_DEP_PATHS = 'os.path.join(path, "nvidia", f"cu{maj_cuda_version}", "lib", lib_name)'
_CUDA_VERSION = re.compile(r"^cuda\b[^=]*=\s*['\"](\d+)\.", re.MULTILINE)


def _torch_cuda_deps(folder: Path) -> list[Path] | None:
    """The files torch/__init__.py's _preload_cuda_deps loads, in its order, found by its rules
    (_get_cuda_dep_paths: nvidia/<folder>/lib, nvidia/cu<major>/lib, <folder>/lib under each
    sys.path entry, the first match); None where that code is not the one read here or a
    required library is missing (torch stops there too)."""
    try:
        source = (folder / "__init__.py").read_text()
        major = _CUDA_VERSION.search((folder / "version.py").read_text())
    except OSError:
        return None
    found = _PRELOAD_LIST.search(source)
    if found is None or major is None or _DEP_PATHS not in source:
        return None
    wanted = [(*pair, True) for pair in _PAIR.findall(found.group(1))] + \
             [(*pair, False) for pair in _OPTIONAL.findall(found.group(2))]
    out = []
    for lib_folder, pattern, required in wanted:
        path = _cuda_dep_path(lib_folder, pattern, major.group(1))
        if path is None and required:
            return None
        out += [] if path is None else [path]
    return out or None


def _cuda_dep_path(lib_folder: str, pattern: str, major: str) -> Path | None:
    for entry in sys.path:
        found = glob.glob(os.path.join(entry, "nvidia", lib_folder, "lib", pattern)) + \
            glob.glob(os.path.join(entry, "nvidia", f"cu{major}", "lib", pattern)) + \
            glob.glob(os.path.join(entry, lib_folder, "lib", pattern))
        if found:
            return Path(found[0])
    return None


def retain_primary_context(device: int = 0, lib: str = LIBCUDA) -> bool:
    """cuInit and cuDevicePrimaryCtxRetain of `device` (service/load/driver.py); False where the
    driver or device is not there."""
    from service.load import driver
    return driver.primary_context(device, lib) is not None


def start_cuda_context() -> threading.Thread:
    """retain_primary_context() on a daemon thread, started now (the caller may join it or not)."""
    thread = threading.Thread(target=retain_primary_context, name="wcodec-cuda-context", daemon=True)
    thread.start()
    return thread
