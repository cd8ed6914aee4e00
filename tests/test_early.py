"""wcodec/early.py: the CUDA context retained through the driver API while torch imports, against
a stand-in libcuda (this machine has no driver), and when `wcodec compress` starts it."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from wcodec import early, entry

FAKE_LIBCUDA = r"""
int retained_device = -1;
int init_result = 0;
int cuInit(unsigned flags) { return flags ? 1 : init_result; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal + 40; return ordinal < 1 ? 0 : 101; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0x1; retained_device = dev; return 0; }
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("libcuda")
    (d / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "fake.c")], check=True)
    return d / "libcuda.so.1"


def test_retains_the_primary_context_of_device_0(fake_libcuda: Path) -> None:
    assert early.retain_primary_context(lib=str(fake_libcuda))
    assert ctypes.c_int.in_dll(ctypes.CDLL(str(fake_libcuda)), "retained_device").value == 40


def test_no_driver_or_no_device_is_no_error(fake_libcuda: Path, tmp_path: Path) -> None:
    assert not early.retain_primary_context(lib=str(tmp_path / "libcuda.so.1"))
    assert not early.retain_primary_context(device=1, lib=str(fake_libcuda))      # cuDeviceGet fails
    ctypes.c_int.in_dll(ctypes.CDLL(str(fake_libcuda)), "init_result").value = 100  # CUDA_ERROR_NO_DEVICE
    assert not early.retain_primary_context(lib=str(fake_libcuda))


@pytest.mark.parametrize("args, wanted", [([], True), (["--device", "cuda"], True), (["--device", "auto"], True),
                                          (["--device", "cpu"], False), (["--device=cpu"], False),
                                          (["--device=cuda"], True)])
def test_compress_starts_the_context_unless_on_the_cpu(args, wanted, monkeypatch, tmp_path: Path) -> None:
    started = []
    monkeypatch.setattr(early, "start_cuda_context", lambda: started.append(True))
    monkeypatch.delenv("WCODEC_EARLY_CUDA", raising=False)
    assert entry.main(["compress", str(tmp_path / "missing"), str(tmp_path / "out.wcodec"), *args]) != 0
    assert started == ([True] if wanted else [])
    monkeypatch.setenv("WCODEC_EARLY_CUDA", "0")
    entry.main(["compress", str(tmp_path / "missing"), str(tmp_path / "out.wcodec"), *args])
    assert len(started) == (1 if wanted else 0)
