"""Codec gguf: GGUF blocks kept as stored planes, decoded by the NumPy reference to exactly what
gguf's dequantizer and torch's cast give (the bits a dense archive of the same file stores)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from codec import errors, gguf_blocks
from codec.constants import CODEC_GGUF, SEGMENT_SYMBOLS
from codec.decode import Archive, load
from tests.conftest import ArchiveBytes
from tests.quantized import GGUF_DTYPES, compress_blocks, quantized_weights, random_blocks, reference_values

TYPES = list(gguf_blocks.BLOCK_TYPES)


@pytest.mark.parametrize("name", TYPES)
def test_planes_partition_the_block_and_join_inverts_split(name):
    bt = gguf_blocks.BLOCK_TYPES[name]
    offsets = sorted(o for _, offs in bt.planes for o in offs)
    assert offsets == list(range(bt.type_size))
    assert all(list(offs) == list(range(offs[0], offs[0] + len(offs))) for _, offs in bt.planes)   # spans
    blocks = random_blocks(bt, 333, seed=bt.code)
    planes = gguf_blocks.split(bt, blocks)
    assert [len(p) for p in planes.values()] == [333 * bt.plane_width(k) for k in bt.plane_names]
    assert np.array_equal(gguf_blocks.join(bt, planes, 333), blocks)


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_every_type_and_compute_dtype(name, tmp_path):
    """Random bytes (all planes raw) and gguf-quantized weights (planes coded, a multi-segment
    plane) decode to gguf's dequantization, cast, in each compute dtype."""
    bt = gguf_blocks.BLOCK_TYPES[name]
    cols = 4 * bt.block_size
    real_rows = -(-SEGMENT_SYMBOLS // (cols // bt.block_size * 16)) + 3        # qs: > one segment
    cases = {"bits": (random_blocks(bt, 12 * 4, seed=1), (12, cols)),
             "real": (quantized_weights(name, real_rows, cols, seed=2), (real_rows, cols))}
    quantized = {f"{kind}.{dt}": (gguf_blocks.Blocks(bt, blocks), shape, GGUF_DTYPES[dt])
                 for kind, (blocks, shape) in cases.items() for dt in GGUF_DTYPES}
    compress_blocks(tmp_path / "q.wcodec", quantized)
    model = load(tmp_path / "q.wcodec", workers=1)
    for key, (blocks, shape, dtype) in quantized.items():
        want = reference_values(bt, blocks.data, shape, dtype)
        assert torch.equal(model.state_dict[key].view(torch.uint8), want.view(torch.uint8)), key
    with Archive.open(tmp_path / "q.wcodec") as archive:
        params = {e.name: e.params for e in archive.entries}
    assert all(p is None for p in params["bits.float32"].planes.values())         # nothing to win
    coded = {k: p for k, p in params["real.bfloat16"].planes.items() if p is not None}
    assert "d_hi" in coded                                    # f16 scales: sign and exponent compress
    if name not in ("Q5_0", "Q5_1"):                          # gguf spreads their 5-bit quants evenly
        assert max(p.n_segments for p in coded.values()) > 1


def _gguf_archive(tmp_path):
    bt = gguf_blocks.BLOCK_TYPES["Q4_1"]
    blocks = quantized_weights("Q4_1", 700, 256, seed=4)
    compress_blocks(tmp_path / "g.wcodec", {"w": (gguf_blocks.Blocks(bt, blocks), (700, 256), torch.bfloat16)})
    return tmp_path / "g.wcodec"


def _rewrite_header(path, tmp_path, change) -> object:
    archive = ArchiveBytes(path.read_bytes())
    header = copy.deepcopy(archive.header)
    change(header["tensors"][0])
    out = tmp_path / "lie.wcodec"
    out.write_bytes(archive.with_header(header))
    return out


LIES = {
    "unknown-type": lambda t: t["params"].update(ggml_type="Q9_9"),
    "params-missing": lambda t: t.pop("params"),
    "plane-missing": lambda t: t["params"]["planes"].pop("qs"),
    "raw-plane-length": lambda t: t["streams"]["d_lo"].update(length=t["streams"]["d_lo"]["length"] - 1),
    "coded-plane-context": lambda t: t["params"]["planes"]["qs"].update(ctx_bits=1),
    "coded-plane-made-raw": lambda t: t["params"]["planes"].update(qs=None),
    "not-whole-blocks": lambda t: t.update(shape=[700, 250], nbytes=700 * 250 * 2),
    "int8-output": lambda t: t.update(dtype="int8", nbytes=700 * 256),
    "extra-stream": lambda t: t["streams"].update(lo=t["streams"]["qs"]),
}


@pytest.mark.parametrize("lie", list(LIES.values()), ids=list(LIES))
def test_header_lies_about_gguf_entries_are_header_errors(lie, tmp_path):
    with pytest.raises(errors.CodecError) as info:
        load(_rewrite_header(_gguf_archive(tmp_path), tmp_path, lie), workers=1)
    assert type(info.value) is errors.HeaderError, info.value


def test_corrupt_coded_plane_is_a_typed_error(tmp_path):
    path = _gguf_archive(tmp_path)
    with Archive.open(path) as archive:
        (entry,) = archive.entries
        assert entry.codec == CODEC_GGUF and entry.params.planes["qs"] is not None
        rec = entry.streams["qs"]
    data = bytearray(path.read_bytes())
    data[rec["offset"] + rec["length"] // 2] ^= 0x41
    path.write_bytes(bytes(data))
    with pytest.raises(errors.ChecksumError):
        load(path, workers=1)
    with pytest.raises(errors.CodecError) as info:
        load(path, workers=1, verify=False)
    assert type(info.value) in (errors.CorruptStreamError, errors.ChecksumError)
    if type(info.value) is errors.CorruptStreamError:
        assert "plane qs" in str(info.value)
