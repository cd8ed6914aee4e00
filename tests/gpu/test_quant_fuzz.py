"""The quantized codecs' CUDA kernels against the C++ twin on fuzzed inputs at odd sizes: byte
planes across segment and 4-segment-block boundaries (decode_bytes), block counts around the
kernel's 4096 weights per block of threads (dequantize_blocks, every byte pattern), int8 tiles
at ragged edges with any scale bits and unaligned tensors (reconstruct_int8), and corrupt fp8
streams, which must fail on the GPU exactly as on the CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import wcodec
from codec import errors, gguf_blocks
from codec.constants import SEGMENT_SYMBOLS
from codec.decode import Archive
from codec.encode import compress_state_dict
from cuda_ext import ops
from tests.quantized import GGUF_DTYPES, many_tensors, random_blocks
from tests.tensors import raw_bytes

S = SEGMENT_SYMBOLS
PLANE_SIZES = [4096, 4099, S - 1, S + 1, 3 * S + 7, 4 * S, 4 * S + 1, 9 * S + 12345]


def skewed_bytes(n: int, seed: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "geometric":                                    # a peaked byte distribution
        return np.minimum(rng.geometric(0.08, n) - 1, 255).astype(np.uint8)
    if kind == "two":                                          # two symbols, one rare
        return np.where(rng.random(n) < 0.02, 200, 7).astype(np.uint8)
    return np.full(n, 93, dtype=np.uint8)                      # one symbol: every step takes no word


@pytest.mark.parametrize("kind", ["geometric", "two", "one"])
def test_decode_bytes_odd_sizes_match_twin(tmp_path, kind):
    state = {f"model.layers.{i}.w{i}": torch.from_numpy(skewed_bytes(n, i, kind)).view(torch.float8_e4m3fn)
             for i, n in enumerate(PLANE_SIZES)}
    compress_state_dict(state, tmp_path / "b.wcodec", workers=2)
    with Archive.open(tmp_path / "b.wcodec") as archive:
        assert all(e.codec == "float" for e in archive.entries)            # every plane is coded
    cpu = wcodec.load(tmp_path / "b.wcodec", "cpu").state_dict
    gpu = wcodec.load(tmp_path / "b.wcodec", "cuda").state_dict
    for name, t in state.items():
        assert torch.equal(raw_bytes(cpu[name]), raw_bytes(t)), name
        assert torch.equal(raw_bytes(gpu[name].cpu()), raw_bytes(t)), name


@pytest.mark.parametrize("name", list(gguf_blocks.BLOCK_TYPES))
def test_dequantize_odd_block_counts_match_twin(name):
    bt = gguf_blocks.BLOCK_TYPES[name]
    per = 4096 // bt.block_size                                # blocks per block of threads
    for count in (1, per - 1, per, per + 1, 7 * per + 3):
        blocks = random_blocks(bt, count, seed=count)
        planes = [torch.from_numpy(np.ascontiguousarray(p)) for p in gguf_blocks.split(bt, blocks).values()]
        for dtype in GGUF_DTYPES.values():
            cpu = torch.empty(count * bt.block_size, dtype=dtype)
            gpu = torch.empty_like(cpu, device="cuda")
            ops.dequantize_blocks(planes, bt.code, [cpu])
            ops.dequantize_blocks([p.cuda() for p in planes], bt.code, [gpu])
            assert torch.equal(raw_bytes(gpu.cpu()), raw_bytes(cpu)), (count, dtype)


def _int8_inputs(rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    tiles = (-(-rows // 16)) * (-(-cols // 16))
    resid = torch.from_numpy(rng.integers(0, 256, rows * cols, dtype=np.uint8))
    modes = torch.from_numpy(rng.integers(0, 5, tiles, dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(0, 1 << 32, rows, dtype=np.uint64).astype(np.uint32)).view(torch.float32)
    return resid, modes, scales                                # scales: any bits (NaN, inf, denormals)


@pytest.mark.parametrize("shape", [(1, 1), (15, 17), (16, 16), (17, 33), (100, 250), (64, 4096), (33, 4104)])
def test_reconstruct_int8_odd_shapes_match_twin(shape):
    resid, modes, scales = _int8_inputs(*shape, seed=shape[0] * 7 + shape[1])
    for dtype in GGUF_DTYPES.values():
        cpu = torch.empty(shape, dtype=dtype)
        ops.reconstruct_int8(resid, modes, scales, cpu)
        gpu = torch.empty(shape, dtype=dtype, device="cuda")
        ops.reconstruct_int8(resid.cuda(), modes.cuda(), scales.cuda(), gpu)
        assert torch.equal(raw_bytes(gpu.cpu()), raw_bytes(cpu)), dtype
        # unaligned output and residuals: the kernel's scalar path
        out = torch.empty(shape[0] * shape[1] + 1, dtype=dtype, device="cuda")[1:].view(shape)
        r = torch.cat([torch.zeros(1, dtype=torch.uint8), resid]).cuda()[1:]
        ops.reconstruct_int8(r, modes.cuda(), scales.cuda(), out)
        assert torch.equal(raw_bytes(out.cpu()), raw_bytes(cpu)), ("unaligned", dtype)


def test_corrupt_fp8_streams_fail_alike(tmp_path):
    """Random byte flips in coded planes: the GPU raises the CPU's error, or both decode the same
    bits (a flip that a status cannot see)."""
    state = {"model.layers.0.w": torch.from_numpy(skewed_bytes(5 * S + 77, 1, "geometric")).view(torch.float8_e5m2)}
    compress_state_dict(state, tmp_path / "c.wcodec", workers=1)
    with Archive.open(tmp_path / "c.wcodec") as archive:
        rec = archive.entries[0].streams["exp"]
    good = (tmp_path / "c.wcodec").read_bytes()
    rng = np.random.default_rng(5)
    raised = 0
    for trial in range(16):
        raw = bytearray(good)
        for at in rng.integers(rec["offset"], rec["offset"] + rec["length"], 3):
            raw[at] ^= int(rng.integers(1, 256))
        path = tmp_path / f"c{trial}.wcodec"
        path.write_bytes(bytes(raw))
        outcome = {}
        for device in ("cpu", "cuda"):
            try:
                outcome[device] = raw_bytes(wcodec.load(path, device, verify=False).state_dict["model.layers.0.w"].cpu())
            except errors.CorruptStreamError as e:
                outcome[device] = str(e)
        if isinstance(outcome["cpu"], str):
            raised += 1
            assert outcome["cuda"] == outcome["cpu"], trial
        else:
            assert not isinstance(outcome["cuda"], str) and torch.equal(outcome["cuda"], outcome["cpu"]), trial
    assert raised >= 12                                         # nearly every flip is caught


@pytest.mark.parametrize("name", list(gguf_blocks.BLOCK_TYPES))
def test_dequantize_many_tensors_in_one_call(name):
    """A list of tensors of one type -- empty ones, one block, kernel-block boundaries, outputs at
    odd addresses (no vector stores) -- in one call, each bit-exact with the twin."""
    bt = gguf_blocks.BLOCK_TYPES[name]
    per = 4096 // bt.block_size
    blocks, planes = many_tensors(bt, [1, 0, per, per + 1, 5 * per - 1, 2], seed=21)
    for dtype in GGUF_DTYPES.values():
        cpu = [torch.empty(len(b) * bt.block_size, dtype=dtype) for b in blocks]
        gpu = [torch.empty(len(b) * bt.block_size + (t % 2), dtype=dtype, device="cuda")[t % 2:]
               for t, b in enumerate(blocks)]
        ops.dequantize_blocks(planes, bt.code, cpu)
        ops.dequantize_blocks([p.cuda() for p in planes], bt.code, gpu)
        for t, (c, g) in enumerate(zip(cpu, gpu)):
            assert torch.equal(raw_bytes(g.cpu()), raw_bytes(c)), (t, dtype)
