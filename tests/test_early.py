"""wcodec/early.py: the CUDA context retained through the driver API while torch imports, against
a stand-in libcuda (this machine has no driver), and when `wcodec compress` starts it."""
from __future__ import annotations

import ctypes
import os
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
    assert "usage:" in capsys.readouterr().err and started == [] and list(tmp_path.iterdir()) == []


def test_torch_libraries_are_found_without_importing_torch(monkeypatch) -> None:
    """This machine's torch is a CPU build: libc10 and libtorch_cpu, as _C's dependencies."""
    assert early.torch_libraries({}) == []                                          # only when asked
    found = early.torch_libraries({"WCODEC_EARLY_DLOPEN": "torch"})
    assert [(p.name, mode) for p, mode in found] == [(n, os.RTLD_NOW | os.RTLD_LOCAL) for n in early.TORCH_LIBRARIES]
    assert found[0][0].parent == Path(torch.__file__).parent / "lib"
    assert early.torch_libraries({"WCODEC_EARLY_DLOPEN": "torch", "TORCH_USE_RTLD_GLOBAL": "1"}) == []
    monkeypatch.setattr(early.importlib.util, "find_spec", lambda name: None)          # no torch to be found
    assert early.torch_libraries({"WCODEC_EARLY_DLOPEN": "torch"}) == []


FAKE_TORCH_INIT = '''
def _preload_cuda_deps(err: OSError | None = None) -> None:
    cuda_libs: list[tuple[str, str]] = [
        # NOTE: Order matters!
        ("cublas", "libcublasLt.so.*[0-9]"),
        ("cublas", "libcublas.so.*[0-9]"),
        ("cuda_runtime", "libcudart.so.*[0-9]"),
    ]
    if err is not None:
        raise err

    for lib_folder, lib_name in cuda_libs:
        _preload_cuda_lib(lib_folder, lib_name)

    # libnvToolsExt is Optional Dependency
    _preload_cuda_lib("nvtx", "libnvToolsExt.so.*[0-9]", required=False)


def _get_cuda_dep_paths(path, lib_folder, lib_name):
    os.path.join(path, "nvidia", f"cu{maj_cuda_version}", "lib", lib_name)
'''


@pytest.fixture
def cuda_torch(tmp_path: Path, monkeypatch) -> Path:
    """A CUDA torch's files as torch 2.11 lays them out, its CUDA libraries in two sys.path entries."""
    folder = tmp_path / "site" / "torch"
    (folder / "lib").mkdir(parents=True)
    (folder / "__init__.py").write_text(FAKE_TORCH_INIT)
    (folder / "version.py").write_text("cuda: Optional[str] = '13.0'\n")
    for name in ("libtorch_cuda.so", early.TORCH_GLOBAL_DEPS, *early.TORCH_LIBRARIES):
        (folder / "lib" / name).touch()
    for where in ("first/nvidia/cu13/lib/libcublasLt.so.13", "site/nvidia/cu13/lib/libcublasLt.so.13",
                  "site/nvidia/cublas/lib/libcublas.so.13", "site/nvidia/cu13/lib/libcudart.so.13"):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).touch()
    monkeypatch.setattr(early, "_torch_folder", lambda: folder)
    monkeypatch.setattr(early.sys, "path", [str(tmp_path / "first"), str(tmp_path / "site")])
    return tmp_path


def test_a_cuda_torch_is_replayed_only_when_asked(cuda_torch: Path) -> None:
    assert early.torch_libraries({}) == []
    found = early.torch_libraries({"WCODEC_EARLY_DLOPEN": "torch"})
    local = os.RTLD_NOW | os.RTLD_LOCAL
    assert [(str(p.relative_to(cuda_torch)), mode) for p, mode in found] == [
        (f"site/torch/lib/{early.TORCH_GLOBAL_DEPS}", os.RTLD_NOW | os.RTLD_GLOBAL),
        ("first/nvidia/cu13/lib/libcublasLt.so.13", local),        # the first sys.path entry with it, as torch
        ("site/nvidia/cublas/lib/libcublas.so.13", local),
        ("site/nvidia/cu13/lib/libcudart.so.13", local),
        *((f"site/torch/lib/{name}", local) for name in early.TORCH_LIBRARIES)]


def test_a_cuda_torch_missing_a_library_or_read_otherwise_is_not_replayed(cuda_torch: Path) -> None:
    (cuda_torch / "site/nvidia/cu13/lib/libcudart.so.13").unlink()
    assert early.torch_libraries({"WCODEC_EARLY_DLOPEN": "torch"}) == []        # torch stops there
    (cuda_torch / "site/nvidia/cu13/lib/libcudart.so.13").touch()
    init = cuda_torch / "site/torch/__init__.py"
    init.write_text(init.read_text().replace('f"cu{maj_cuda_version}"', 'f"cuda{maj_cuda_version}"'))
    assert early.torch_libraries({"WCODEC_EARLY_DLOPEN": "torch"}) == []        # other rules than those read here


@pytest.fixture
def serve_started(monkeypatch):
    """What `wcodec serve` starts before torch imports, recorded instead of done; the run stops
    where the early reads would start."""
    import sys

    from service.load import driver
    from wcodec import serve
    calls: list = []
    monkeypatch.setattr(serve.preload, "start", lambda libs, **kw: calls.append(("dlopen", [p.name for p, _ in libs])))
    monkeypatch.setattr(driver, "start_primary_context",
                        lambda device=0, **kw: calls.append(("cuda",) if device == 0 else ("cuda", device)))
    monkeypatch.setattr(serve, "_start_early_reads", lambda *a: (_ for _ in ()).throw(SystemExit(3)))
    for name in ("WCODEC_EARLY_DLOPEN", "WCODEC_EARLY_CUDA", "WCODEC_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    switch = sys.getswitchinterval()            # run() shortens it before the early reads
    yield calls
    sys.setswitchinterval(switch)


@pytest.mark.parametrize("env, expected", [
    ({}, [("cuda",)]),
    ({"WCODEC_DEVICE": "cpu"}, []),
    ({"WCODEC_EARLY_DLOPEN": "torch", "WCODEC_DEVICE": "cpu"}, [("dlopen", list(early.TORCH_LIBRARIES))]),
    ({"WCODEC_EARLY_DLOPEN": "torch", "WCODEC_EARLY_CUDA": "0"}, [("dlopen", list(early.TORCH_LIBRARIES))]),
    ({"WCODEC_EARLY_DLOPEN": "0", "WCODEC_DEVICE": "cuda"}, [("cuda",)]),
    ({"WCODEC_DEVICE": "cuda:1"}, [("cuda", 1)]),
])
def test_serve_starts_the_dlopen_and_the_context_unless_told_not(env, expected, serve_started, monkeypatch,
                                                                  tmp_path: Path) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        entry.main(["serve", "--store", str(tmp_path)])
    assert serve_started == expected
