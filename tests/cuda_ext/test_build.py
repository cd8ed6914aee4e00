"""Finding a JIT build (cuda_ext/build.py): a library already in the cache directory is loaded
directly, without torch's build tools, dlopened first with the GIL released (unless
WCODEC_EARLY_DLOPEN=0); one that does not load is built again; the directory's name follows the
sources' flags, so a changed flag never loads an old build."""
from __future__ import annotations

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


def test_the_library_is_dlopened_with_the_gil_released_first(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WCODEC_EXT_CACHE", str(tmp_path))
    built = build._cache_dir(False) / "wcodec_ext.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF")
    calls = []
    monkeypatch.setattr(build, "dlopen_released", lambda path: calls.append(("released", path)))
    monkeypatch.setattr(build.torch.ops, "load_library", lambda path: calls.append(("load_library", path)))
    monkeypatch.delenv("WCODEC_EARLY_DLOPEN", raising=False)
    build._jit(False)
    assert calls == [("released", built), ("load_library", str(built))]
    calls.clear()
    monkeypatch.setenv("WCODEC_EARLY_DLOPEN", "0")
    build._jit(False)
    assert calls == [("load_library", str(built))]


def test_the_prebuilt_module_is_found_without_importing_it() -> None:
    import importlib.util
    spec = importlib.util.find_spec("cuda_ext._C")
    assert build._aot_file() == (spec.origin if spec is not None else None)


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
