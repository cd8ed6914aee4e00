"""Host memory: how much is available (`available_memory`), where a mapping starts (`address_of`),
dropping an early read's pages (`unmap`), and giving memory back to the system after an unload
(glibc malloc; a no-op elsewhere).

Read me first -- why an unloaded model's memory stayed resident (docs/RELIABILITY.md, "leak"):
- It was not a leak: across 25 load -> generate -> unload cycles of the demo model on the CPU,
  glibc's `mallinfo2().uordblks` (bytes in use) stayed at 136 MB after every unload, and no tensor
  survived (`gc`). What grew was `fordblks`, free bytes that malloc kept: 44 MB after cycle 1,
  784 MB after cycle 25, and the resident size with it (456 -> 1212 MB).
- Cause: glibc's *dynamic* mmap threshold. A freed mmapped block raises the threshold to its size
  (up to 32 MiB), so from the first unload on, every weight tensor under 32 MiB came from the
  heap arenas of the loading threads instead of its own mmap, and freed arena memory is not
  returned to the kernel unless the arena's top is free.
- Fix: `tune_allocator()` pins the threshold at glibc's initial 128 KiB, which turns the dynamic
  adjustment off (weights are mmapped and unmapped on free), and `release()` runs `malloc_trim(0)`
  after an unload, which returns the free pages inside the arenas (tokenizer and Python objects).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap

log = logging.getLogger("wcodec.service")
_libc = ctypes.CDLL(None, use_errno=True)

M_MMAP_THRESHOLD = -3                  # <malloc.h>
MMAP_THRESHOLD = 128 << 10             # glibc's initial value; setting it disables the dynamic one


class MallInfo2(ctypes.Structure):
    """glibc >= 2.33 `struct mallinfo2`: totals over every arena."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version, libc.malloc_trim, libc.mallopt  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


def tune_allocator() -> bool:
    """Pin glibc's mmap threshold (large blocks are unmapped when freed); False without glibc."""
    libc = _glibc()
    ok = libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    log.debug("malloc mmap threshold pinned at %d bytes: %s", MMAP_THRESHOLD, ok)
    return ok


def release() -> bool:
    """Return free heap pages to the kernel (`malloc_trim(0)`); False without glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def malloc_stats() -> dict[str, int] | None:
    """glibc's own accounting, in bytes: in use, free but kept, mmapped; None without mallinfo2."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    return {"heap_bytes": m.arena, "in_use_bytes": m.uordblks, "free_kept_bytes": m.fordblks,
            "mmapped_bytes": m.hblkhd}


CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),                 # v2
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_memory(meminfo: str = "/proc/meminfo", cgroups=CGROUP_FILES) -> int:
    """Bytes this process may still take: the machine's MemAvailable, or less where the process's
    cgroup (a container's memory limit: Kubernetes' `limits.memory`, `docker run -m`) leaves less.
    In a container /proc/meminfo is the node's, so without the cgroup a host cache sized from it
    could take the pod past its limit."""
    free = _meminfo_available(meminfo)
    for limit_file, usage_file in cgroups:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:      # v1's "no limit" is ~2**63
            return max(0, min(free, limit - usage))
    return free


def _meminfo_available(path: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_int(path: str) -> int | None:
    """An integer file of the cgroup filesystem; None where it is absent or says "max" (no limit)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def address_of(buf: mmap.mmap) -> int:
    """Where `buf`'s memory starts (for madvise, cudaHostRegister)."""
    ref = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(ref)
    del ref                                        # the buffer export ends with it
    return address


def unmap(buf: mmap.mmap, chunk: int = 256 << 20) -> None:
    """Drop `buf`'s pages a chunk at a time (madvise through ctypes, which lets other threads run
    meanwhile), then close it."""
    try:
        address = address_of(buf)
        for off in range(0, len(buf), chunk):
            _libc.madvise(ctypes.c_void_p(address + off), ctypes.c_size_t(min(chunk, len(buf) - off)),
                          mmap.MADV_DONTNEED)
        buf.close()
    except (BufferError, AttributeError, OSError, TypeError, ValueError):
        pass                                       # left to the garbage collector
