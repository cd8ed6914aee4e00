"""service/load/driver.py and the early read's page-locking (early_read.page_lock_early), against
a stand-in libcuda that records what it is asked (this machine has no driver): the memory
registered whole in the context retained, unregistered when the read is freed, and every failure
a pageable read, loaded through the ring as before; and its reads going wide when its load begins."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from codec.encode import compress_state_dict
from service.load import driver
from service.load.early_read import EarlyRead
from service.load.memory import address_of
from service.load.pipeline import decode_archive
from service.timeline import Timeline

FAKE_LIBCUDA = r"""
#include <stddef.h>
void *current = 0, *registered = 0;
size_t registered_bytes = 0;
int register_result = 0, registrations = 0, unregistrations = 0;
int cuInit(unsigned flags) { return 0; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal < 1 ? 0 : 101; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0x5000; return 0; }
int cuCtxSetCurrent(void *ctx) { current = ctx; return 0; }
int cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    if (current != (void *)0x5000 || flags) return 201;
    if (register_result) return register_result;
    registered = p; registered_bytes = n; registrations++; return 0;
}
int cuMemHostUnregister(void *p) { if (p != registered) return 1; registered = 0; unregistrations++; return 0; }
"""


@pytest.fixture
def libcuda(tmp_path: Path, monkeypatch) -> ctypes.CDLL:
    cc = shutil.which("cc") or pytest.skip("no C compiler")
    (tmp_path / "fake.c").write_text(FAKE_LIBCUDA)
    lib = tmp_path / "libcuda-fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "fake.c")], check=True)
    monkeypatch.setattr(driver, "LIBCUDA", str(lib))
    return ctypes.CDLL(str(lib))


def _int(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.c_int.in_dll(lib, name).value


def test_the_primary_context_and_page_locking(libcuda: ctypes.CDLL, tmp_path: Path) -> None:
    ctx = driver.primary_context(lib=driver.LIBCUDA)
    assert ctx == 0x5000 and driver.primary_context(device=1, lib=driver.LIBCUDA) is None
    assert driver.start_primary_context(lib=driver.LIBCUDA).result(timeout=10) == 0x5000
    buf = (ctypes.c_char * 4096)()
    assert driver.page_lock(ctypes.addressof(buf), 4096, ctx)
    assert ctypes.c_size_t.in_dll(libcuda, "registered_bytes").value == 4096
    assert driver.page_unlock(ctypes.addressof(buf), ctx) and not driver.page_unlock(ctypes.addressof(buf), ctx)
    ctypes.c_int.in_dll(libcuda, "register_result").value = 2                        # CUDA_ERROR_OUT_OF_MEMORY
    assert not driver.page_lock(ctypes.addressof(buf), 4096, ctx)
    assert driver.primary_context(lib=str(tmp_path / "missing.so")) is None
    assert not driver.page_lock(ctypes.addressof(buf), 4096, ctx, lib=str(tmp_path / "missing.so"))


@pytest.fixture
def archive(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(256, 384, generator=g).bfloat16() for i in range(3)}
    path = tmp_path / "m.wcodec"
    compress_state_dict(state, path, workers=1)
    return path, state


def _read(path: Path) -> EarlyRead:
    return EarlyRead(str(path), verify=True, threads=2, direct=None, timeline=Timeline())


def _context(value: int | None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def test_an_early_read_is_page_locked_whole_and_unlocked_when_freed(libcuda: ctypes.CDLL, archive) -> None:
    path, state = archive
    read = _read(path)
    read.page_lock_early(_context(0x5000))
    assert read.wait_pinned() and _int(libcuda, "registrations") == 1
    assert ctypes.c_size_t.in_dll(libcuda, "registered_bytes").value == read.mapped_bytes
    assert ctypes.c_void_p.in_dll(libcuda, "registered").value == address_of(read.buf)
    names = [e.name for e in read.timeline.entries()]
    assert any(n.endswith("page-locked through the driver") for n in names)
    decoded = decode_archive(path, torch.device("cpu"), early=read)      # release(): freed, not kept
    assert all(torch.equal(decoded.tensors[k], v) for k, v in state.items())
    assert _int(libcuda, "unregistrations") == 1 and not read.pinned


@pytest.mark.parametrize("ctx, result", [(None, 0), (0x5000, 2)])
def test_no_context_or_a_failed_registration_leaves_the_read_pageable(libcuda: ctypes.CDLL, archive, ctx,
                                                                      result) -> None:
    ctypes.c_int.in_dll(libcuda, "register_result").value = result
    read = _read(archive[0])
    read.page_lock_early(_context(ctx))
    assert not read.wait_pinned()
    read.release()
    assert _int(libcuda, "unregistrations") == 0


def test_a_read_never_asked_is_not_waited_for(archive) -> None:
    read = _read(archive[0])
    assert not read.wait_pinned()
    read.release()


def test_serve_page_locks_the_early_reads_unless_told_not(monkeypatch) -> None:
    from wcodec.serve import _page_lock_early_reads

    asked: list[Future] = []

    class Read:
        def page_lock_early(self, context) -> None:
            asked.append(context)

    context = _context(0x5000)
    _page_lock_early_reads({"a": Read(), "b": Read()}, context, environ={})
    assert asked == [context, context]
    _page_lock_early_reads({"a": Read()}, context, environ={"WCODEC_EARLY_PIN": "0"})
    _page_lock_early_reads({"a": Read()}, None, environ={})
    assert len(asked) == 2


def test_the_host_cache_does_not_lock_a_read_locked_at_start_up(monkeypatch) -> None:
    from service.load import hostcache

    class Read:
        buf, mapped_bytes, pinned = bytearray(8), 8, True

        def wait_pinned(self) -> bool:
            return self.pinned

    locked = []
    monkeypatch.setattr(hostcache, "_page_lock", lambda address, nbytes: locked.append(nbytes) or True)
    entry = hostcache._Entry(("key",), Read())
    entry.pin()
    entry.pinning.join()
    assert locked == [] and entry.read.pinned


def test_an_early_read_goes_wide_when_its_load_begins(archive) -> None:
    """The early load opens the import gate before it decodes, not when the imports end."""
    from service.load.early_read import ImportGate
    gate = ImportGate()
    read = EarlyRead(str(archive[0]), verify=True, threads=2, direct=None, timeline=Timeline(), gate=gate)
    assert not gate.is_open()
    read.go_wide()
    read.go_wide()                                  # once
    assert gate.is_open()
    assert sum(e.name.endswith("wide (its load begins)") for e in read.timeline.entries()) == 1
    read.release()
    _read(archive[0]).go_wide()                     # no gate: nothing to open
