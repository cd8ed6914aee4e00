"""wcodec/early.py: the CUDA context retained through the driver API while torch imports, against
a stand-in libcuda (this machine has no driver), and when `wcodec compress` starts it."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

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


@pytest.fixture
def started(monkeypatch) -> list[str]:
    """The early work `wcodec compress` starts, recorded instead of done."""
    calls: list[str] = []
    monkeypatch.setattr(early, "start_cuda_context", lambda: calls.append("cuda"))
    for name in ("WCODEC_EARLY_CUDA", "WCODEC_PREFILL"):
        monkeypatch.delenv(name, raising=False)
    return calls


@pytest.mark.parametrize("args, cuda", [([], True), (["--device", "cuda"], True), (["--device=cpu"], False),
                                        (["--device", "cpu"], False)])
def test_compress_starts_the_context_unless_on_the_cpu(args, cuda, started, monkeypatch, tmp_path: Path) -> None:
    assert entry.main(["compress", str(tmp_path / "missing"), str(tmp_path / "out.wcodec"), *args]) != 0
    assert started == (["cuda"] if cuda else [])
    monkeypatch.setenv("WCODEC_EARLY_CUDA", "0")
    entry.main(["compress", str(tmp_path / "missing"), str(tmp_path / "out.wcodec"), *args])
    assert len(started) == (1 if cuda else 0)


def test_compress_writes_over_its_prefill(started, tmp_path: Path, monkeypatch, capsys) -> None:
    """The archive is the same bytes with and without the prefill, which the timings report."""
    src = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(500, 300, generator=torch.Generator().manual_seed(0)).bfloat16()}, str(src))
    monkeypatch.setenv("WCODEC_TIMINGS", "1")
    monkeypatch.setenv("WCODEC_PREFILL", "1")
    assert entry.main(["compress", str(src), str(tmp_path / "a.wcodec"), "--device", "cpu"]) == 0
    assert "compress prefill: " in capsys.readouterr().err
    monkeypatch.setenv("WCODEC_PREFILL", "0")
    assert entry.main(["compress", str(src), str(tmp_path / "b.wcodec"), "--device", "cpu"]) == 0
    assert "compress prefill: " not in capsys.readouterr().err
    assert (tmp_path / "a.wcodec").read_bytes() == (tmp_path / "b.wcodec").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wcodec", "b.wcodec", "t.safetensors"]


def test_a_failed_compress_leaves_no_prefill(started, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WCODEC_PREFILL", "1")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(b"not safetensors" * 1000)
    assert entry.main(["compress", str(tmp_path / "src"), str(tmp_path / "out.wcodec"), "--device", "cpu"]) == 1
    assert early.source_bytes(str(tmp_path / "src")) == 15000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("codec, flag, cpus, wanted", [("lossless", None, 16, True), ("lossless", None, 2, False),
                                                      ("lossless", "1", 2, True), ("lossless", "0", 16, False),
                                                      ("int8", "1", 16, False)])
def test_the_prefill_is_for_lossless_archives_beside_free_cores(codec, flag, cpus, wanted, monkeypatch) -> None:
    monkeypatch.setattr(early.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert early._prefill_wanted(codec, flag) == wanted


def test_usage_errors_start_nothing(started, tmp_path: Path, capsys) -> None:
    assert entry.main(["compress", str(tmp_path / "x"), "--device", "gpu"]) == 2
    err = capsys.readouterr().err                     # one line (0ef3d3c), argparse's usage before
    assert err.startswith("wcodec compress: error: argument --device") and err.count("\n") == 1
    assert started == [] and list(tmp_path.iterdir()) == []
