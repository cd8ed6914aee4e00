"""The int8 predictive codec (lossy, opt-in): quantization, the five tile predictors and their exact
inverse, mode choice by coded size, the archive round trip (reference and C++ twin give the same
bits, the bits the encoder promised), header lies and corrupt modes as typed errors."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import wcodec
from codec import errors, int8
from codec.decode import Archive, load
from codec.encode import compress_source
from codec.sources import StateDictSource
from tests.conftest import ArchiveBytes
from tests.tensors import raw_bytes

SHAPES = [(1, 1), (1, 40), (40, 1), (16, 16), (17, 15), (33, 70), (64, 48)]


def _resid_for(q: np.ndarray, modes: np.ndarray) -> np.ndarray:
    res = int8.residuals(q)
    tm = np.broadcast_to(modes[:, None, :, None], res.shape[1:]).astype(np.int64)
    return np.ascontiguousarray(int8._untile(np.take_along_axis(res, tm[None], axis=0)[0], q.shape))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_mode_inverts_exactly(shape):
    """Extremes +-127 next to each other (planar's clamp, average's floor of negatives) and random
    values, every mode, partial edge tiles; mixed modes across tiles."""
    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    q = rng.choice(np.array([-127, 127, -1, 0, 1, 64, -64], np.int8), size=shape)
    q[::2] = rng.integers(-127, 128, size=q[::2].shape)
    tiles = (-(-shape[0] // 16), -(-shape[1] // 16))
    for modes in [np.full(tiles, m, np.uint8) for m in range(5)] + [rng.integers(0, 5, tiles).astype(np.uint8)]:
        assert np.array_equal(int8.reconstruct(_resid_for(q, modes), modes), q), modes


def test_quantization_is_per_row_symmetric():
    w = np.array([[0.5, -1.0, 0.25], [0, 0, 0], [3.0, 1.5, -0.0]], np.float32)
    q, s = int8.quantize(w)
    assert np.array_equal(s, np.float32([1.0, 0, 3.0]) / np.float32(127))
    assert np.array_equal(q, np.array([[64, -127, 32], [0, 0, 0], [127, 64, 0]], np.int8))   # rint: 63.5 -> 64


def test_predictors_win_only_where_they_lower_the_size():
    rng = np.random.default_rng(0)
    smooth = np.cumsum(np.cumsum(rng.standard_normal((64, 96)), 0), 1).astype(np.float32)
    noise = rng.standard_normal((64, 96)).astype(np.float32)
    assert int8.mode_shares(int8.choose_modes(int8.quantize(noise)[0]))["none"] == 24
    shares = int8.mode_shares(int8.choose_modes(int8.quantize(smooth)[0]))
    assert shares["none"] < 24 and shares["planar"] + shares["average"] + shares["left"] + shares["top"] > 12


def _compress(tmp_path, state) -> tuple:
    with StateDictSource(state) as source:
        stats = compress_source(source, tmp_path / "i.wcodec", workers=1, lossy="int8")
    return tmp_path / "i.wcodec", stats


def test_archive_round_trip_reference_and_twin(tmp_path):
    g = torch.Generator().manual_seed(0)
    smooth = torch.cumsum(torch.cumsum(torch.randn(40, 300, generator=g), 0), 1)
    state = {"w.bf16": (torch.randn(300, 200, generator=g) * 0.02).bfloat16(),
             "w.f16": (torch.randn(70, 130, generator=g)).half(),
             "w.f32": smooth.float(),
             "bias": torch.randn(300, generator=g),                          # 1-D: stays lossless
             "small": torch.randn(10, 10, generator=g).bfloat16()}           # < 4096 elements: lossless
    path, stats = _compress(tmp_path, state)
    assert set(stats.quality) == {"w.bf16", "w.f16", "w.f32"} and min(q["snr_db"] for q in stats.quality.values()) > 35
    with Archive.open(path) as archive:
        entries = {e.name: e for e in archive.entries}
    assert {n for n, e in entries.items() if e.codec == "int8"} == set(stats.quality)
    assert entries["w.f32"].params.mode_tiles[0] < sum(entries["w.f32"].params.mode_tiles)     # predictors won
    ref = load(path, workers=1).state_dict
    twin = wcodec.load(path, "cpu").state_dict
    for name, t in state.items():
        assert torch.equal(raw_bytes(ref[name]), raw_bytes(twin[name])), name
        if name in stats.quality:
            q, s = int8.quantize(t.float().numpy())
            assert torch.equal(raw_bytes(ref[name]), raw_bytes(int8.dequantize(q, s, t.dtype))), name
        else:
            assert torch.equal(raw_bytes(ref[name]), raw_bytes(t)), name


def test_weights_with_nan_or_inf_stay_lossless(tmp_path):
    """A NaN or an infinity would make its row's scale infinite and the whole row NaN: such a
    weight is float-coded, bit-exact; its finite neighbour is still int8."""
    g = torch.Generator().manual_seed(2)
    bad = (torch.randn(64, 128, generator=g) * 0.02).bfloat16()
    bad[3, 5], bad[40, 0] = float("nan"), float("-inf")
    inf32 = torch.randn(64, 128, generator=g)
    inf32[9, :4] = float("inf")
    state = {"bad": bad, "inf32": inf32, "good": (torch.randn(64, 128, generator=g) * 0.02).bfloat16()}
    path, stats = _compress(tmp_path, state)
    assert set(stats.quality) == {"good"}
    with Archive.open(path) as archive:
        assert {e.name: e.codec for e in archive.entries} == {"bad": "float", "inf32": "float", "good": "int8"}
    got = load(path, workers=1).state_dict
    for name in ("bad", "inf32"):
        assert torch.equal(raw_bytes(got[name]), raw_bytes(state[name])), name


LIES = {
    "one-dimensional": lambda t: t.update(shape=[t["shape"][0] * t["shape"][1]]),
    "tile-8": lambda t: t["params"].update(tile=8),
    "mode-tiles-sum": lambda t: t["params"]["mode_tiles"].__setitem__(0, t["params"]["mode_tiles"][0] + 1),
    "planes-missing": lambda t: t["params"]["planes"].pop("modes"),
    "scales-length": lambda t: t["streams"]["scales"].update(length=t["streams"]["scales"]["length"] - 4),
    "resid-context": lambda t: t["params"]["planes"]["resid"].update(ctx_bits=2),
}


@pytest.mark.parametrize("lie", list(LIES.values()), ids=list(LIES))
def test_header_lies_are_header_errors(lie, tmp_path):
    path, _ = _compress(tmp_path, {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(1))})
    archive = ArchiveBytes(path.read_bytes())
    header = copy.deepcopy(archive.header)
    lie(header["tensors"][0])
    (tmp_path / "lie.wcodec").write_bytes(archive.with_header(header))
    with pytest.raises(errors.CodecError) as info:
        load(tmp_path / "lie.wcodec", workers=1)
    assert type(info.value) is errors.HeaderError, info.value


def test_unknown_tile_mode_is_a_corrupt_stream(tmp_path):
    path, _ = _compress(tmp_path, {"w": torch.randn(64, 128, generator=torch.Generator().manual_seed(2))})
    archive = ArchiveBytes(path.read_bytes())
    assert archive.tensor("w")["params"]["planes"]["modes"] is None             # raw: 32 bytes
    modes = bytearray(archive.stream("w", "modes"))
    modes[3] = 7
    (tmp_path / "bad.wcodec").write_bytes(archive.with_stream("w", "modes", bytes(modes)))
    for decode in (lambda p: load(p, workers=1, verify=False), lambda p: wcodec.load(p, "cpu", verify=False)):
        with pytest.raises(errors.CorruptStreamError, match="tile mode is 7"):
            decode(tmp_path / "bad.wcodec")
