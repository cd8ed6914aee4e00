"""CUDA decoder: bit-exact against the C++ twin and the NumPy reference, statuses on corrupt data."""
from __future__ import annotations

import os

import pytest
import torch

import cuda_ext
import wcodec
from codec.constants import SEGMENT_SYMBOLS
from codec.decode import Archive, load
from codec.encode import compress_state_dict
from codec.errors import CorruptStreamError
from cuda_ext import ops, plans
from tests.decoding import MODES, every_mode, overlapping_segments, run_op, shifted
from tests.tensors import make_tensor, same_bits

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
def fuzz_tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Weights salted with every bit-pattern class: NaN payloads, +-Inf, -0, denormals."""
    return make_tensor(dtype, (n,), seed, "mixed")


def decode_everywhere(path) -> tuple[dict, dict, dict]:
    cuda = wcodec.load(path, "cuda").state_dict
    cpp = wcodec.load(path, "cpu").state_dict
    ref = load(path, workers=1).state_dict
    return cuda, cpp, ref


def test_extension_is_live():
    avail = cuda_ext.available()
    assert avail.cuda and avail.cpp, avail


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_opcheck(device):
    args, _ = ops.sample_inputs(device)
    for a in args:
        torch.library.opcheck(torch.ops.wcodec.decode_pieces.default, a)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entry_steps", [8, 64, 256, 4096])
def test_every_mode_matches_the_twin(dtype, entry_steps, tmp_path):
    """Bulk, recording the index, and pieces from it: CUDA and the C++ twin give the same bits,
    record the same index, and decode pieces at odd sizes and piece boundaries."""
    sizes = [4096, 33 * 32 + 7, 256 * 32 - 1, 256 * 32 + 1, SEGMENT_SYMBOLS + 1, 2 * SEGMENT_SYMBOLS + 8 * 32 * 5 + 3]
    state = {f"t{i}": fuzz_tensor(dtype, n, seed=40 + i) for i, n in enumerate(sizes)}
    path = tmp_path / "m.wcodec"
    compress_state_dict(state, path, workers=1)
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    cpu = every_mode(ops.decode_pieces, data, p, entry_steps)
    gpu = every_mode(ops.decode_pieces, data.cuda(), p, entry_steps)
    for mode in MODES:
        assert int(gpu[mode][0].abs().sum()) == 0 and int(cpu[mode][0].abs().sum()) == 0, mode
        for e, a, b in zip(p.float_entries, gpu[mode][1], cpu[mode][1]):
            assert same_bits(a, b) and same_bits(b, state[e.name]), (mode, e.name)
    for a, b in zip(gpu[plans.MODE_RECORD][2], cpu[plans.MODE_RECORD][2]):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("shift", [2, 6, 10])
def test_streams_at_unaligned_addresses(shift, tmp_path):
    """Streams that start off 4-, 8- and 16-byte boundaries take the kernel's unvectorised paths
    (hi bytes one at a time, renormalisation words loaded and stored at once): the same bits,
    statuses and index as the aligned decode, in every mode. (Odd addresses are refused before any
    launch by the argument check the CPU twin shares: tests/cuda_ext/test_twin.py.)"""
    state = {f"t{i}": fuzz_tensor(dtype, n, seed=70 + i) for i, (dtype, n) in
             enumerate([(torch.bfloat16, SEGMENT_SYMBOLS + 33), (torch.float32, 5000), (torch.float16, 4099)])}
    path = tmp_path / "m.wcodec"
    compress_state_dict(state, path, workers=1)
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy()).cuda()
    aligned = every_mode(ops.decode_pieces, data, p, 64)
    unaligned = every_mode(ops.decode_pieces, *shifted(data, p, shift), 64)
    for mode in MODES:
        assert int(unaligned[mode][0].abs().sum()) == 0, mode
        for e, a, b in zip(p.float_entries, unaligned[mode][1], aligned[mode][1]):
            assert same_bits(a, b) and same_bits(a, state[e.name]), (mode, e.name)
    for a, b in zip(unaligned[plans.MODE_RECORD][2], aligned[plans.MODE_RECORD][2]):
        assert torch.equal(a, b)


def test_corrupt_index_entry_is_a_status(tmp_path):
    state = {"w": fuzz_tensor(torch.bfloat16, 2 * SEGMENT_SYMBOLS, seed=8)}
    path = tmp_path / "i.wcodec"
    compress_state_dict(state, path, workers=1)
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy()).cuda()
    states, words = run_op(ops.decode_pieces, data, p, plans.MODE_RECORD, 256)[2]
    for entry in (1, 7, 18):
        s2, w2 = states.clone(), words.clone()
        s2[entry * 32 + 9] ^= 1 << 20
        w2[entry + 1] -= 1
        status = run_op(ops.decode_pieces, data, p, plans.MODE_INDEXED, 256, (s2, w2))[0].cpu()
        assert int(status[entry - 1]) != 0 and int(status[entry]) != 0, entry
    torch.cuda.synchronize()


def test_overlapping_segments_are_a_status_as_in_the_twin(tmp_path):
    p, data, index = overlapping_segments(tmp_path / "o.wcodec")
    for mode in MODES:
        idx = index if mode == plans.MODE_INDEXED else None
        twin = run_op(ops.decode_pieces, data, p, mode, 256 if mode else 0, idx)[0]
        cuda = run_op(ops.decode_pieces, data.cuda(), p, mode, 256 if mode else 0,
                      None if idx is None else tuple(t.cuda() for t in idx))[0].cpu()
        assert int(cuda.abs().sum()) != 0 and torch.equal(cuda, twin), mode
    torch.cuda.synchronize()


def test_prepared_launch_allocates_nothing(tmp_path):
    """The hot path: a Prepared INDEXED launch into caller-owned outputs makes no allocation."""
    state = {"q": fuzz_tensor(torch.bfloat16, 512 * 1024, seed=2).reshape(512, 1024)}
    path = tmp_path / "p.wcodec"
    compress_state_dict(state, path, workers=1)
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy()).cuda()
    _, index = cuda_ext.build_index(p, data, 256)
    out = [torch.empty(512, 1024, dtype=torch.bfloat16, device="cuda")]
    job = cuda_ext.Prepared(p, data, out, plans.MODE_INDEXED, index)
    job.run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(10):
        job.run()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    job.check()
    assert same_bits(out[0], state["q"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fuzz_bit_exact(dtype, tmp_path):
    sizes = [4096, 4097, 5000, 33 * 32 + 7, SEGMENT_SYMBOLS - 1, SEGMENT_SYMBOLS, SEGMENT_SYMBOLS + 1,
             3 * SEGMENT_SYMBOLS + 12345]
    sizes = [max(n, 4096) for n in sizes]
    state = {f"t{i}": fuzz_tensor(dtype, n, seed=i) for i, n in enumerate(sizes)}
    state["matrix"] = fuzz_tensor(dtype, 333 * 1001, seed=99).reshape(333, 1001)
    state["one"] = torch.tensor([1.5], dtype=dtype)                     # raw path, one element
    path = tmp_path / "fuzz.wcodec"
    compress_state_dict(state, path, workers=1)
    cuda, cpp, ref = decode_everywhere(path)
    for name, t in state.items():
        assert cuda[name].is_cuda
        assert same_bits(cuda[name], t) and same_bits(cpp[name], t) and same_bits(ref[name], t), name


def test_batch_over_2_31_elements(tmp_path):
    """One launch whose tensors hold more than 2**31 elements in total (64-bit sizes and offsets)."""
    n, k = 1 << 28, 9                                                    # 9 * 2**28 = 2.4e9 elements
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {f"w{i}": (torch.randn(n, generator=g, device="cuda") * 0.02).bfloat16().cpu() for i in range(k)}
    path = tmp_path / "big.wcodec"
    compress_state_dict(state, path, workers=min(16, os.cpu_count() or 1))
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        assert p.n_segments * SEGMENT_SYMBOLS >= k * n > 2**31
    out = wcodec.load(path, "cuda", verify=False).state_dict
    for name, t in state.items():
        assert torch.equal(out[name].view(torch.int16), t.cuda().view(torch.int16)), name


def _corrupt_exp(path, where: float) -> None:
    with Archive.open(path) as archive:
        rec = next(e for e in archive.entries if e.codec == "float").streams["exp"]
    buf = bytearray(open(path, "rb").read())
    pos = rec["offset"] + int(rec["length"] * where)
    buf[pos] ^= 0x5A
    open(path, "wb").write(bytes(buf))


@pytest.mark.parametrize("where", [0.0, 0.001, 0.3, 0.9])
def test_corrupt_stream_is_a_status_not_a_fault(where, tmp_path):
    state = {"w": fuzz_tensor(torch.bfloat16, 2 * SEGMENT_SYMBOLS + 5, seed=3)}
    path = tmp_path / "c.wcodec"
    compress_state_dict(state, path, workers=1)
    _corrupt_exp(path, where)
    with pytest.raises(CorruptStreamError):
        out = wcodec.load(path, "cuda", verify=False).state_dict     # skip CRCs: reach the kernel
        assert not same_bits(out["w"], state["w"]), "a flip that changes nothing must not happen here"
    torch.cuda.synchronize()                                             # the context survived


DEMO_PARTS = [p for p in os.environ.get("WCODEC_DEMO_GGUF", "").split(",") if p]


@pytest.mark.skipif(not DEMO_PARTS, reason="WCODEC_DEMO_GGUF names no demo-model GGUF (parts)")
@pytest.mark.parametrize("part", DEMO_PARTS)
def test_demo_model_bit_exact(part, tmp_path):
    from codec.encode import compress
    from codec.sources import open_source
    path = tmp_path / "demo.wcodec"
    compress(part, path, workers=8)
    cuda, cpp, ref = decode_everywhere(path)
    with open_source(part) as src:
        for info in src.tensors():
            t = src.load(info.name)
            assert same_bits(cuda[info.name], t) and same_bits(cpp[info.name], t), info.name
            assert same_bits(ref[info.name], t), info.name
    print(f"demo part {os.path.basename(part)}: {len(cuda)} tensors bit-exact (cuda, c++, numpy)")
