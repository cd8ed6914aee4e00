"""The C++ twin of the quantized codecs (decode_bytes, dequantize_blocks) against the NumPy reference
behind the same op interface, and against gguf's own dequantizer: bit for bit, NaN scales included."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda_ext
import wcodec
from codec import errors, floatcodec, gguf_blocks, tables
from codec.constants import SEGMENT_SYMBOLS, STREAM_ALIGN
from codec.decode import load as reference_load
from codec.floatcodec import FloatParams
from cuda_ext import ops, plans
from tests.quantized import (F16_FIELDS, GGUF_DTYPES, compress_blocks, corrupt_q8_archive, many_tensors, quantized_weights,
                             random_blocks, reference_values, scale_sweep)
from tests.tensors import make_tensor, raw_bytes

TYPES = list(gguf_blocks.BLOCK_TYPES)


@pytest.fixture(scope="module", autouse=True)
def twin():
    avail = cuda_ext.available()
    assert avail.cpp, f"the C++ twin must build in CI: {avail.reason}"


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_twin_is_gguf_bit_for_bit(name):
    """Every f16 scale value (NaN payloads, infinities, denormals) in each scale field, random
    quants, and gguf-quantized weights; in each compute dtype."""
    bt = gguf_blocks.BLOCK_TYPES[name]
    blocks = np.concatenate([quantized_weights(name, 64, 4 * bt.block_size, seed=1), random_blocks(bt, 999, seed=2)]
                            + [scale_sweep(bt, f, seed=3 + i) for i, f in enumerate(F16_FIELDS[name])])
    numel = len(blocks) * bt.block_size
    values = reference_values(bt, blocks, (numel,), torch.float32)
    planes = [torch.from_numpy(p) for p in gguf_blocks.split(bt, blocks).values()]
    for dtype in GGUF_DTYPES.values():
        out = torch.empty(numel, dtype=dtype)
        ops.dequantize_blocks(planes, bt.code, [out])
        want = values.to(dtype)
        bad = torch.nonzero(raw_bytes(out).view(-1, dtype.itemsize) != raw_bytes(want).view(-1, dtype.itemsize))
        assert len(bad) == 0, (dtype, int(bad[0, 0]) // bt.block_size)


def _coded(sym: np.ndarray, group: int | None = None) -> tuple[bytes, FloatParams]:
    """A byte plane coded even where raw would be smaller (the decoder must not care)."""
    n_seg = -(-len(sym) // SEGMENT_SYMBOLS)
    group = min(group or n_seg, n_seg)
    fine = floatcodec._fine_counts(sym, np.zeros(len(sym), np.uint8), n_seg)
    params = FloatParams(len(sym), 0, group)
    p = floatcodec.Prepared(None, params, tables.normalize(floatcodec._grouped(fine, 0, group)), sym, None, None)
    return floatcodec.encode_batch([p])[0], params


PLANES = {"one": np.array([7], np.uint8), "lane": np.arange(31, dtype=np.uint8), "step": np.arange(33, dtype=np.uint8),
          "constant": np.full(SEGMENT_SYMBOLS + 5, 9, np.uint8),
          "random": np.random.default_rng(0).integers(0, 256, 3 * SEGMENT_SYMBOLS + 77, dtype=np.uint8),
          "skewed": np.clip(np.random.default_rng(1).normal(128, 6, 4 * SEGMENT_SYMBOLS + 1), 0, 255).astype(np.uint8),
          "segment": np.random.default_rng(2).integers(0, 5, SEGMENT_SYMBOLS, dtype=np.uint8)}


def _byte_batch(groups: dict[str, int | None]):
    """Every plane of PLANES coded into one data buffer, with its descriptor rows."""
    blob, rows, first = bytearray(), [], 0
    for name, sym in PLANES.items():
        stream, params = _coded(sym, groups.get(name))
        off = len(blob)
        blob += stream + b"\0" * (-len(stream) % STREAM_ALIGN)
        rows.append([off, len(stream), -1, -1, params.n, 0, params.table_group, plans.BYTES_CODE, first])
        first += params.n_segments
    return torch.frombuffer(blob, dtype=torch.uint8).clone(), torch.tensor(rows, dtype=torch.int64), first


def _run(fn, data, desc, n_status):
    outputs = [torch.full((int(r[4]),), 0xAB, dtype=torch.uint8) for r in desc.tolist()]
    status = torch.zeros(n_status, dtype=torch.int32)
    fn(data, desc, outputs, status)
    return status, outputs


@pytest.mark.parametrize("groups", [{}, {"random": 4, "skewed": 4}], ids=["one-set", "sets-of-4"])
def test_decode_bytes_twin_matches_reference_and_symbols(groups):
    data, desc, n_status = _byte_batch(groups)
    for fn in (ops.decode_bytes, ops.reference_decode_bytes):
        status, outputs = _run(fn, data, desc, n_status)
        assert int(status.abs().sum()) == 0, fn
        for (name, sym), out in zip(PLANES.items(), outputs):
            assert np.array_equal(out.numpy(), sym), (fn, name)


def test_decode_bytes_reports_corruption_like_the_reference():
    data, desc, n_status = _byte_batch({})
    rng = np.random.default_rng(3)
    rows = desc.tolist()
    for pos in rng.integers(0, len(data), 40).tolist():
        bad = data.clone()
        bad[pos] ^= 0x5A
        st_t, out_t = _run(ops.decode_bytes, bad, desc, n_status)
        st_n, out_n = _run(ops.reference_decode_bytes, bad, desc, n_status)
        for r, row in enumerate(rows):
            segs = slice(row[8], row[8] + -(-row[4] // SEGMENT_SYMBOLS))
            assert bool(st_t[segs].any()) == bool(st_n[segs].any()), (pos, r)
            if st_n[segs].any() and int(st_n[segs].max()) <= 2:          # a word or state mismatch
                assert torch.equal(st_t[segs], st_n[segs]), (pos, r)
            if not st_n[segs].any():
                assert torch.equal(out_t[r], out_n[r]), (pos, r)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_dequantize_a_list_of_tensors(name):
    """One call dequantizes each tensor of a list from its own planes, as calls one by one would."""
    bt = gguf_blocks.BLOCK_TYPES[name]
    blocks, planes = many_tensors(bt, [3, 0, 17, 1], seed=11)
    outs = [torch.empty(len(b) * bt.block_size, dtype=torch.bfloat16) for b in blocks]
    ops.dequantize_blocks(planes, bt.code, outs)
    n = len(bt.plane_names)
    for t, (b, out) in enumerate(zip(blocks, outs)):
        alone = torch.empty_like(out)
        ops.dequantize_blocks(planes[t * n:(t + 1) * n], bt.code, [alone])
        want = torch.empty_like(out)
        ops.reference_dequantize_blocks(planes[t * n:(t + 1) * n], bt.code, [want])
        assert torch.equal(raw_bytes(out), raw_bytes(alone)) and torch.equal(raw_bytes(out), raw_bytes(want)), t
    with pytest.raises(RuntimeError, match="dtype"):
        ops.dequantize_blocks(planes, bt.code, outs[:3] + [outs[3].float()])


def test_opcheck_quant_ops_cpu():
    data, desc, n_status = _byte_batch({})
    outputs = [torch.empty(int(r[4]), dtype=torch.uint8) for r in desc.tolist()]
    torch.library.opcheck(torch.ops.wcodec.decode_bytes.default,
                          (data, desc, outputs, torch.zeros(n_status, dtype=torch.int32)))
    bt = gguf_blocks.BLOCK_TYPES["Q4_K"]
    planes = [torch.from_numpy(p) for p in gguf_blocks.split(bt, random_blocks(bt, 8, seed=5)).values()]
    torch.library.opcheck(torch.ops.wcodec.dequantize_blocks.default,
                          (planes, bt.code, [torch.empty(8 * bt.block_size, dtype=torch.bfloat16)]))


def test_caller_mistakes_are_refused():
    bt = gguf_blocks.BLOCK_TYPES["Q8_0"]
    planes = [torch.from_numpy(p) for p in gguf_blocks.split(bt, random_blocks(bt, 4, seed=6)).values()]
    with pytest.raises(RuntimeError, match="planes"):
        ops.dequantize_blocks(planes[:2], bt.code, [torch.empty(128, dtype=torch.float32)])
    with pytest.raises(RuntimeError, match="no dequantizer"):
        ops.dequantize_blocks(planes, 10, [torch.empty(128, dtype=torch.float32)])
    with pytest.raises(RuntimeError, match="plane"):
        ops.dequantize_blocks(planes, bt.code, [torch.empty(160, dtype=torch.float32)])


def test_extension_load_of_mixed_archive_matches_reference(tmp_path):
    """bf16 (decode_pieces), fp8 (decode_bytes straight into the tensor), and GGUF blocks of every
    type (decode_bytes, then dequantize_blocks) through cuda_ext.load: the reference's bits."""
    shapes = {name: (40, bt.block_size * (2 if bt.block_size == 256 else 16)) for name, bt in gguf_blocks.BLOCK_TYPES.items()}
    quantized = {f"q.{name}": (gguf_blocks.Blocks(gguf_blocks.BLOCK_TYPES[name], quantized_weights(name, *shape, seed=7)),
                               shape, torch.bfloat16) for name, shape in shapes.items()}
    dense = {"bf16": make_tensor(torch.bfloat16, (SEGMENT_SYMBOLS + 9,), 1, "normal"),
             "e4m3": make_tensor(torch.float8_e4m3fn, (70_000,), 2, "mixed"),
             "e5m2": make_tensor(torch.float8_e5m2, (5000,), 3, "normal")}
    compress_blocks(tmp_path / "m.wcodec", quantized, dense)
    want = reference_load(tmp_path / "m.wcodec", workers=1).state_dict
    got = wcodec.load(tmp_path / "m.wcodec", "cpu").state_dict
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(raw_bytes(got[name]), raw_bytes(want[name])), name
    for name in dense:
        assert torch.equal(raw_bytes(got[name]), raw_bytes(dense[name])), name


def test_extension_load_names_the_corrupt_plane(tmp_path):
    path = corrupt_q8_archive(tmp_path / "c.wcodec")
    with pytest.raises(errors.CorruptStreamError, match="stream qs: segment"):
        wcodec.load(path, "cpu", verify=False)


@pytest.mark.parametrize("shape", [(1, 1), (17, 15), (40, 300)], ids=str)
def test_reconstruct_int8_twin_matches_reference(shape):
    """Every mode (and mixed modes), every compute dtype, scales including 0, inf, NaN and
    denormals: the twin's bits are the reference's."""
    from codec import int8
    rng = np.random.default_rng(shape[1])
    q = rng.integers(-127, 128, size=shape).astype(np.int8)
    scales = (rng.random(shape[0]) * 1e-2).astype(np.float32)
    scales[::7] = np.array([0, np.inf, np.nan, 1e-42, -0.0, 3e38, 1.0], np.float32)[:len(scales[::7])]
    tiles = (-(-shape[0] // 16), -(-shape[1] // 16))
    for modes in [np.full(tiles, m, np.uint8) for m in range(5)] + [rng.integers(0, 5, tiles).astype(np.uint8)]:
        res = int8.residuals(q)
        tm = np.broadcast_to(modes[:, None, :, None], res.shape[1:]).astype(np.int64)
        resid = np.ascontiguousarray(int8._untile(np.take_along_axis(res, tm[None], axis=0)[0], q.shape))
        args = (torch.from_numpy(resid.reshape(-1)), torch.from_numpy(modes.reshape(-1).copy()), torch.from_numpy(scales))
        for dtype in GGUF_DTYPES.values():
            got, want = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            ops.reconstruct_int8(*args, got)
            ops.reference_reconstruct_int8(*args, want)
            assert torch.equal(raw_bytes(got), raw_bytes(want)), (modes.ravel()[:3], dtype)
            assert torch.equal(raw_bytes(want), raw_bytes(int8.dequantize(q, scales, dtype)))
