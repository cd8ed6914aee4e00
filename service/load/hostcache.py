"""Compressed archives kept in host memory between loads, so that a model switch (an unload, then
a load again) reads no file: vLLM's sleep mode and Triton's model swapping keep weights the same
way. Read me first.

    miss   the load reads the archive whole into host memory (early_read.EarlyRead: every stream
           verified as it arrives), decodes from there, and the cache keeps it. On CUDA it is then
           page-locked in place (one cudaHostRegister of the whole mapping) on a thread of its own:
           19-21 GB/s on an H100 box (bench/experiments/probe_h2d.py), off the load's path.
    hit    every stream is verified again, so a bit flipped in host RAM fails the load with
           ChecksumError and the entry is dropped: on a GPU by the loader, on the device after the
           copy (service/load/devicecheck.py; the cache is then asked with verify=False); else from
           memory by a pool (EarlyRead.recheck), batch by batch ahead of the decode. Page-locked:
           each batch goes straight from the cached pages to the device on the copy stream (no
           ring, no file); not yet: through the pinned ring.

* Keyed by the file's identity: absolute path, st_dev, st_ino, st_size, st_mtime_ns. A file
  rewritten since is a miss, and its stale entry is dropped.
* A byte budget (WCODEC_HOST_CACHE_BYTES): before an archive is kept, the least recently used
  idle entries are evicted until it fits. An entry in use by a load is never evicted; an archive
  that cannot fit (or is over half the available memory) is loaded as without the cache.
* Evicted memory is unlocked and unmapped by a thread (EarlyRead.free). The cache belongs to the
  model registry (one per server process) and is emptied when the registry closes.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from codec.errors import CodecError

from ..timeline import Timeline
from .early_read import EarlyRead
from .memory import address_of, available_memory
from .reading import align_up, identity

log = logging.getLogger("wcodec.service")

Key = tuple[str, int, int, int, int]          # absolute path, st_dev, st_ino, st_size, st_mtime_ns


def key_of(path: str) -> Key:
    return (os.path.abspath(path), *identity(path))


@dataclass(frozen=True)
class Use:
    """What a load gets from the cache: `read` is decode_archive's `early` (None: read the file)."""
    read: EarlyRead | None
    source: str                    # where the bytes come from: "host cache", "file" or "early read"
    looked: bool = False           # the cache is on and was asked: a hit or a miss
    hit: bool = False


def _page_lock(address: int, nbytes: int) -> bool:
    """cudaHostRegister [address, address + nbytes) in one call; False (nothing locked) when it
    fails. One registration, because an asynchronous copy must lie inside one: a batch spanning
    two registered chunks failed with cudaErrorInvalidValue on an H100. Runs on a thread of its
    own: a failed call's error stays that thread's last CUDA error, where no kernel launch check
    can mistake it for its own."""
    import torch
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)       # cudaHostRegisterDefault
    if int(err) != 0:
        log.warning("host cache: page-locking failed (%s); hits copy through the pinned ring", err)
    return int(err) == 0


class _Entry:
    def __init__(self, key: Key, read: EarlyRead):
        self.key, self.read, self.nbytes = key, read, read.mapped_bytes
        self.busy = True           # a load is using it: never evicted
        self.pinning: threading.Thread | None = None

    def pin(self) -> None:
        def run() -> None:
            self.read.pinned = _page_lock(address_of(self.read.buf), self.nbytes)
        self.pinning = threading.Thread(target=run, name="wcodec-host-cache-pin", daemon=True)
        self.pinning.start()

    def free(self) -> None:
        """Unlock and unmap, on a thread (unmapping 9 GB took ~1 s); no copy reads it any more."""
        def run() -> None:
            if self.pinning is not None:
                self.pinning.join()
            if self.read.pinned:
                import torch
                self.read.pinned = False
                torch.cuda.cudart().cudaHostUnregister(address_of(self.read.buf))
            self.read.free()
        threading.Thread(target=run, name="wcodec-host-cache-free", daemon=True).start()


class HostCache:
    """Archives by absolute path, least recently used first; `budget` bytes at most (0: off);
    `pin`: page-lock what is kept (a CUDA server)."""

    def __init__(self, budget: int, *, pin: bool, timeline: Timeline | None = None):
        self.budget, self.pin, self.timeline = budget, pin, timeline or Timeline()
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()    # LRU first
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None   # rechecks of hits; its threads outlive a load
        self._pool_threads = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._used()

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.read.pinned)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def peek(self, path: str) -> EarlyRead | None:
        """The kept read of `path`, whatever its identity (tests, debugging)."""
        with self._lock:
            entry = self._entries.get(os.path.abspath(path))
            return entry.read if entry is not None else None

    @contextmanager
    def use(self, path: str, *, verify: bool, threads: int, direct: bool | None,
            early: EarlyRead | None = None) -> Iterator[Use]:
        """The archive's bytes for one load: kept ones (a hit), else a new read that is kept if
        the load succeeds. `early`: the start-up read of this archive, kept instead of a new one.
        A load that raises drops the entry."""
        entry, use = self._checkout(path, verify, threads, direct, early)
        try:
            yield use
        except BaseException:
            if entry is not None:
                self._drop(entry)
            raise
        if entry is not None:
            self._checkin(entry)

    def _checkout(self, path: str, verify: bool, threads: int, direct: bool | None,
                  early: EarlyRead | None) -> tuple[_Entry | None, Use]:
        plain = Use(early, "early read" if early is not None else "file")
        if self.budget <= 0:
            return None, plain
        try:
            key = key_of(path)
        except OSError:
            return None, plain                     # the load reports it
        entry = self._hit(key)
        if entry is not None:
            if verify or not entry.read.blobs.complete:  # else no task at all (on CUDA the loader checks the GPU copy)
                entry.read.recheck(verify, self._recheck_pool(threads))
            log.info("host cache hit: %s (%.3f GB, %s)", path, entry.nbytes / 1e9,
                     "page-locked" if entry.read.pinned else "not page-locked yet" if self.pin else "pageable")
            return entry, Use(entry.read, "host cache", looked=True, hit=True)
        entry, why = self._admit(key, lambda: early if early is not None and early.matches(path) else
                                 EarlyRead(key[0], verify=verify, threads=threads, direct=direct, timeline=self.timeline))
        log.info("host cache miss: %s; %s", path, why)
        read = entry.read if entry is not None else early
        return entry, Use(read, "early read" if read is not None and read is early else "file", looked=True)

    def _hit(self, key: Key) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key[0])
            if entry is None or entry.busy:
                return None
            if entry.key != key:                   # the file was replaced: what we hold is stale
                self._remove(entry)
                return None
            entry.busy = True
            self._entries.move_to_end(key[0])
            return entry

    def adopt(self, path: str, read: EarlyRead) -> bool:
        """Keep `read` (a start-up read that a preload has decoded from, marked `kept` so that it
        was not freed) as if a load through the cache had made it; else free it. A preloaded model
        switched out and back in then reads no file either."""
        try:
            entry, why = self._admit(key_of(path), lambda: read) \
                if self.budget > 0 and read.matches(path) else (None, "not kept: the cache is off or the file changed")
        except OSError as e:
            entry, why = None, f"not kept: {e}"
        log.info("host cache: the start-up read of %s %s", path, "kept" if entry is not None else why)
        if entry is None:
            read.kept = False
            read.free()
            return False
        self._checkin(entry)
        return True

    def _admit(self, key: Key, make: Callable[[], EarlyRead]) -> tuple[_Entry | None, str]:
        """Room for the archive of `key` (least recently used idle entries evicted), then `make()`
        its read, kept."""
        size, available = align_up(key[3]), available_memory()
        if size > self.budget or (available and size > available // 2):
            return None, "not kept: over the budget or half the available memory"
        with self._lock:
            if key[0] in self._entries:
                return None, "not kept: another load is using the kept copy"
            for other in [e for e in self._entries.values() if not e.busy]:    # least recently used first
                if self._used() + size <= self.budget:
                    break
                log.info("host cache: evicting %s (%.3f GB)", other.key[0], other.nbytes / 1e9)
                self._remove(other)
            if self._used() + size > self.budget:
                return None, "not kept: the budget is held by loads in progress"
            try:
                read = make()
            except (OSError, CodecError) as e:
                return None, f"not kept: {e}"      # the load reads the file and reports it
            read.kept = True
            entry = self._entries[key[0]] = _Entry(key, read)
            return entry, "kept after this load"

    def _used(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def _remove(self, entry: _Entry) -> None:
        """With the lock held: forget the entry and free its memory."""
        if self._entries.get(entry.key[0]) is entry:
            del self._entries[entry.key[0]]
        entry.free()

    def _checkin(self, entry: _Entry) -> None:
        with self._lock:                           # pinning starts before any eviction can free it
            entry.busy = False
            if self._entries.get(entry.key[0]) is entry:
                self._entries.move_to_end(entry.key[0])
                if self.pin and entry.pinning is None:
                    entry.pin()

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            self._remove(entry)
        log.info("host cache: dropped %s (its load failed)", entry.key[0])

    def _recheck_pool(self, threads: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool_threads != threads:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="wcodec-recheck")
                self._pool_threads = threads
            return self._pool

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._entries.values()):
                self._remove(entry)
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
