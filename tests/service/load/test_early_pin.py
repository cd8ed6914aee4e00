"""Early pins (service/load/early_pin.py): the ring size read from the header (the early read's
`window`) is the one a load's ring takes; CUDA's runtime library is found as torch would load it,
or not at all on a CPU-only torch; without one, the pin makes nothing and the early load pins its
ring itself. tests/gpu runs it for real through the cold start (scripts/gpu/run.sh cold-start)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from codec.decode import Archive
from service.load import early_pin
from service.load.reading import layer_window
from service.load.ring import layer_batches, ring_shape
from service.timeline import Timeline


def test_the_header_gives_the_rings_buffer_size(demo_archive: Path) -> None:
    with Archive.open(demo_archive) as archive:
        entries, records = archive.entries, archive.reader.header["tensors"]
    size = ring_shape(4, layer_batches(entries))[1]
    assert layer_window(records) == layer_window(entries) == size
    assert layer_window([]) == 4096


def _fake_install(root: Path, cuda: str | None) -> Path:
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    (root / "torch" / "version.py").write_text(f"cuda: Optional[str] = {cuda!r}\n")
    lib = root / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    for name in ("libcudart.so.12", "libcudart.so.13"):
        (lib / name).write_bytes(b"")
    return lib / "libcudart.so.13"


@pytest.mark.parametrize("cuda", ["13.0", None])
def test_the_runtime_library_is_torchs_cuda_majors(tmp_path: Path, monkeypatch, cuda) -> None:
    want = _fake_install(tmp_path, cuda)
    specs = {n: importlib.util.spec_from_file_location(n, tmp_path / n / "__init__.py",
                                                       submodule_search_locations=[str(tmp_path / n)])
             for n in ("torch", "nvidia")}
    monkeypatch.setattr(early_pin.importlib.util, "find_spec", specs.get)
    assert early_pin.runtime_library() == (str(want) if cuda else None)


def test_without_a_runtime_nothing_is_pinned(monkeypatch) -> None:
    monkeypatch.setattr(early_pin, "runtime_library", lambda: None)
    pin = early_pin.EarlyPin(0, 4, 1 << 20, Timeline())
    assert pin.take() == [] and pin.pointers == []
    if not torch.cuda.is_available():
        assert early_pin.runtime_library() is None                     # this CPU-only torch


def test_cuda_index_of_the_device_setting() -> None:
    assert [early_pin.cuda_index(d) for d in (None, "cuda", "cuda:3", "cpu", "cudax")] == [0, 0, 3, None, None]
