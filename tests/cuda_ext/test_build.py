"""Finding a JIT build (cuda_ext/build.py): a library already in the cache directory is loaded
directly, without torch's build tools; one that does not load is built again; the directory's
name follows the sources' flags, so a changed flag never loads an old build."""
from __future__ import annotations

import re
from pathlib import Path

import torch.utils.cpp_extension

from cuda_ext import build


def test_a_built_library_loads_without_the_build_tools(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WCODEC_EXT_CACHE", str(tmp_path))
    built = build._cache_dir(False) / "wcodec_ext.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF")
    loaded, built_again = [], []
    monkeypatch.setattr(build.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: built_again.append(kw))
    build._jit(False)
    assert loaded == [str(built)] and built_again == []


def test_a_library_that_does_not_load_is_built_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WCODEC_EXT_CACHE", str(tmp_path))
    built = build._cache_dir(False) / "wcodec_ext.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"half a library")                   # a build interrupted while linking
    built_again = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: built_again.append(kw))
    build._jit(False)
    assert [kw["name"] for kw in built_again] == ["wcodec_ext"]
    assert built_again[0]["build_directory"] == str(built.parent)


def test_the_directory_follows_the_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WCODEC_EXT_CACHE", str(tmp_path))
    before = build._cache_dir(True)
    monkeypatch.setattr(build, "NVCC_FLAGS", build.NVCC_FLAGS + ["-G"])
    assert build._cache_dir(True) != before
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert len({before, build._cache_dir(True), build._cache_dir(False)}) == 3


def test_setup_py_and_the_jit_build_compile_every_source_file() -> None:
    """setup.py (pip install, the images) and build.py (the JIT build, scripts/gpu/prebuild.sh) list
    the extension's sources apart: both must name every .cpp and .cu file of csrc/ (a file one of
    them misses links, and fails only when the extension loads on that path)."""
    listed = set(re.findall(r'"(\w+\.(?:cpp|cu))"', (Path(build.__file__).parents[1] / "setup.py").read_text()))
    on_disk = {p.name for p in build.CSRC.iterdir() if p.suffix in (".cpp", ".cu")}
    assert listed == set(build.CPU_SOURCES) | set(build.CUDA_SOURCES) == on_disk
