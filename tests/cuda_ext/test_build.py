"""Finding a JIT build (cuda_ext/build.py): a library already in the cache directory is loaded
directly, without torch's build tools; one that does not load is built again; the directory's
name follows the sources' flags, so a changed flag never loads an old build."""
from __future__ import annotations

import shutil

import pytest
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


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ldd") is None, reason="needs c++ and ldd")
def test_a_compiler_that_links_libstdcxx_statically_is_refused(tmp_path) -> None:
    """Such a build's formatted TORCH_CHECKs crashed the process (SIGSEGV) instead of raising: the
    JIT build refuses the compiler, and cuda_ext falls back with that reason."""
    build._check_shared_runtime("c++")                                  # links it as a shared library
    static = tmp_path / "c++"
    static.write_text('#!/bin/sh\nexec c++ -static-libstdc++ "$@"\n')
    static.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"links libstdc\+\+ statically"):
        build._check_shared_runtime(str(static))
