"""`wcodec.load`, the Python API of README's "Python" section."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import wcodec
from codec.encode import compress


def weight() -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32).to(torch.bfloat16).reshape(64, 64)


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    src, dst = tmp_path / "t.safetensors", tmp_path / "t.wcodec"
    save_file({"w": weight()}, str(src))
    compress(src, dst, workers=1)
    return dst


def test_load_on_the_cpu_is_bit_exact(archive: Path) -> None:
    model = wcodec.load(archive, "cpu")
    assert torch.equal(model.state_dict["w"], weight())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", [None, "cuda", "cuda:0"])
def test_cuda_without_a_gpu_says_so(archive: Path, device: str | None) -> None:
    """README's `wcodec.load("model.wcodec", "cuda")` (and the default) raised pin_memory's
    'requires a CUDA or other accelerator backend; no pinned memory allocator is available'."""
    with pytest.raises(RuntimeError, match=r"^wcodec.load: device 'cuda(:0)?', but torch sees no CUDA GPU"):
        wcodec.load(archive) if device is None else wcodec.load(archive, device)
