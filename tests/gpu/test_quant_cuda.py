"""CUDA decoders of the quantized codecs (decode_bytes, dequantize_blocks) against the C++ twin and
gguf: bit for bit, NaN scales included; statuses on corrupt planes. Written without a GPU: these
tests have not run yet (docs/BENCHMARKS.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import wcodec
from codec import errors, gguf_blocks
from cuda_ext import ops
from tests.quantized import (F16_FIELDS, GGUF_DTYPES, compress_blocks, corrupt_q8_archive, quantized_weights,
                             random_blocks, scale_sweep)
from tests.tensors import make_tensor, raw_bytes

TYPES = list(gguf_blocks.BLOCK_TYPES)


def test_quant_kernels_are_registered():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("wcodec::decode_bytes", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("wcodec::dequantize_blocks", "CUDA")


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_cuda_matches_twin(name):
    bt = gguf_blocks.BLOCK_TYPES[name]
    blocks = np.concatenate([quantized_weights(name, 64, 4 * bt.block_size, seed=1), random_blocks(bt, 999, seed=2)]
                            + [scale_sweep(bt, f, seed=3 + i) for i, f in enumerate(F16_FIELDS[name])])
    planes = [torch.from_numpy(p) for p in gguf_blocks.split(bt, blocks).values()]
    for dtype in GGUF_DTYPES.values():
        cpu = torch.empty(len(blocks) * bt.block_size, dtype=dtype)
        gpu = torch.empty_like(cpu, device="cuda")
        ops.dequantize_blocks(planes, bt.code, [cpu])
        ops.dequantize_blocks([p.cuda() for p in planes], bt.code, [gpu])
        assert torch.equal(raw_bytes(gpu.cpu()), raw_bytes(cpu)), dtype


def test_mixed_archive_on_cuda_matches_twin(tmp_path):
    shapes = {name: (40, bt.block_size * (2 if bt.block_size == 256 else 16)) for name, bt in gguf_blocks.BLOCK_TYPES.items()}
    quantized = {f"q.{name}": (gguf_blocks.Blocks(gguf_blocks.BLOCK_TYPES[name], quantized_weights(name, *shape, seed=7)),
                               shape, torch.bfloat16) for name, shape in shapes.items()}
    dense = {"e4m3": make_tensor(torch.float8_e4m3fn, (300_000,), 2, "mixed"),
             "e5m2": make_tensor(torch.float8_e5m2, (5000,), 3, "normal")}
    compress_blocks(tmp_path / "m.wcodec", quantized, dense)
    cpu = wcodec.load(tmp_path / "m.wcodec", "cpu").state_dict
    gpu = wcodec.load(tmp_path / "m.wcodec", "cuda").state_dict
    for name, t in cpu.items():
        assert gpu[name].device.type == "cuda" and torch.equal(raw_bytes(gpu[name].cpu()), raw_bytes(t)), name


def test_corrupt_plane_on_cuda_is_typed(tmp_path):
    path = corrupt_q8_archive(tmp_path / "c.wcodec")
    with pytest.raises(errors.CorruptStreamError, match="stream qs: segment"):
        wcodec.load(path, "cuda", verify=False)


def test_reconstruct_int8_cuda_matches_twin():
    from codec import int8
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 520)).astype(np.float32)
    z = int8.encode(np.cumsum(w, axis=1))
    args = [torch.from_numpy(z.resid.reshape(-1)), torch.from_numpy(z.modes.reshape(-1).copy()), torch.from_numpy(z.scales)]
    for dtype in GGUF_DTYPES.values():
        cpu, gpu = torch.empty(z.q.shape, dtype=dtype), torch.empty(z.q.shape, dtype=dtype, device="cuda")
        ops.reconstruct_int8(*args, cpu)
        ops.reconstruct_int8(*[a.cuda() for a in args], gpu)
        assert torch.equal(raw_bytes(gpu.cpu()), raw_bytes(cpu)), dtype
