"""Lossless fp8 (codec float, the whole byte coded): every byte value of both formats round trips
through the reference and the C++ twin; on real weights cast the way fp8 checkpoints are made it
stores less than the raw bytes and less than ZipNN on the same bytes."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import wcodec
from codec.constants import CODEC_FLOAT
from codec.decode import Archive, load
from codec.encode import compress_state_dict
from tests.tensors import raw_bytes
from wcodec import cli
from wcodec.bench import fp8_cast

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _every_byte(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """fp8 weights (so that the plane is worth coding) with each of the 256 byte values spliced in
    four times, at random places."""
    gen = torch.Generator().manual_seed(seed)
    weights = fp8_cast(torch.randn(128, 128, generator=gen), dtype, "row").reshape(-1).view(torch.uint8).clone()
    at = torch.randperm(weights.numel(), generator=gen)[:1024]
    weights[at] = torch.arange(256, dtype=torch.uint8).repeat(4)
    return weights.view(dtype)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_every_byte_value_round_trips(dtype, tmp_path):
    """NaN (e4m3fn 0x7F / 0xFF; e5m2's payloads), +-inf (e5m2), -0 and denormals are symbols like
    any other: the decoded bytes are the stored bytes, by the reference and by the twin."""
    state = {"all": _every_byte(dtype, 1), "weights": fp8_cast(torch.randn(96, 128), dtype, "block")}
    assert len(torch.unique(state["all"].view(torch.uint8))) == 256
    compress_state_dict(state, tmp_path / "f.wcodec", workers=1)
    with Archive.open(tmp_path / "f.wcodec") as archive:
        entries = {e.name: e for e in archive.entries}
    assert all(e.codec == CODEC_FLOAT and set(e.streams) == {"exp"} for e in entries.values())
    assert entries["all"].params.ctx_bits == 0
    for model in (load(tmp_path / "f.wcodec", workers=1), wcodec.load(tmp_path / "f.wcodec", "cpu")):
        for name, t in state.items():
            got = model.state_dict[name]
            assert got.dtype == dtype and torch.equal(raw_bytes(got), raw_bytes(t)), name


@pytest.fixture(scope="module")
def minilm_fp8(minilm_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    sd = {k: v for k, v in load_file(str(minilm_dir / "model.safetensors")).items() if v.dim() == 2}
    return {f"{str(dt)[6:]}-{scales}": {k: fp8_cast(v, dt, scales) for k, v in sd.items()}
            for dt in FP8 for scales in ("row", "block")}


# Measured 2026-11-23 (docs/BENCHMARKS.md): whole archive / raw fp8 bytes, MiniLM-L6's 2-D weights.
BOUNDS = {"float8_e4m3fn": 0.84, "float8_e5m2": 0.72}


@pytest.mark.parametrize("case", ["float8_e4m3fn-row", "float8_e4m3fn-block", "float8_e5m2-row", "float8_e5m2-block"])
def test_real_fp8_weights_compress_below_zipnn(minilm_fp8, case, tmp_path):
    state = minilm_fp8[case]
    stats = compress_state_dict(state, tmp_path / "m.wcodec", workers=2)
    assert stats.ratio < BOUNDS[case.split("-")[0]], stats
    model = load(tmp_path / "m.wcodec", workers=2)
    assert all(torch.equal(raw_bytes(model.state_dict[k]), raw_bytes(v)) for k, v in state.items())
    if importlib.util.find_spec("zipnn") is None:
        pytest.skip("zipnn is not installed")
    from zipnn import ZipNN
    coder = ZipNN(input_format="byte", bytearray_dtype=case.split("-")[0], threads=1)
    zipped = sum(len(coder.compress(bytearray(raw_bytes(v).numpy().tobytes()))) for v in state.values())
    assert stats.file_bytes < zipped, (stats.file_bytes, zipped)


def test_bench_prints_fp8_ratio_beside_zipnn(minilm_dir: Path, tmp_path: Path, capsys):
    sd = load_file(str(minilm_dir / "model.safetensors"))
    few = {k: v for k, v in sd.items() if ".0." in k or ".1." in k}
    save_file(few, str(tmp_path / "few.safetensors"))
    code = cli.main(["bench", str(tmp_path / "few.safetensors"), "--cast", "float8_e4m3fn", "--fp8-scales", "block",
                     "--repeat", "1", "--threads", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["cast"] == "float8_e4m3fn (block scales)"
    assert out["tensors"] == sum(1 for v in few.values() if v.dim() == 2)
    assert out["raw_bytes"] == sum(v.numel() for v in few.values() if v.dim() == 2)       # one byte each
    assert 0.7 < out["ratio"] < 0.86                              # measured 0.838 (the whole file)
    if importlib.util.find_spec("zipnn") is not None:
        assert out["ratio"] < out["peers"]["zipnn"]["ratio"] < 0.9     # zipnn: 0.840
