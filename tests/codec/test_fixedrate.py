"""The fixed-rate GPU form's NumPy reference (codec/fixedrate.py): lossless for every 16-bit
pattern and shape, the code and escape-list layouts the kernels rely on, the base rule, and its size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from codec import fixedrate as F
from codec.errors import CodecError
from tests.tensors import make_tensor

SHAPES = [(1, 1), (3, 31), (2, 33), (5, 127), (4, 129), (7, 1000), (3, 1024), (2, 4096 + 160), (0, 64)]


def words(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_every_16_bit_pattern_round_trips():
    w = np.arange(1 << 16, dtype=np.uint16).reshape(64, 1024)
    for order in (w, w.T.copy(), np.random.default_rng(0).permutation(w.reshape(-1)).reshape(256, 256)):
        assert np.array_equal(F.decode(F.encode(order)), order)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bits", "normal", "mixed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_bit_exact(dtype, kind, shape):
    w = words(make_tensor(dtype, shape, seed=sum(shape), kind=kind))
    fr = F.encode(w)
    assert np.array_equal(F.decode(fr), w)
    assert fr.plane.shape == (shape[0], F.groups_for(shape[1]) * F.GROUP)
    assert fr.tile.shape == (shape[0], F.tiles_for(shape[1]))
    assert fr.esc_start.shape == (shape[0], F.blocks_for(shape[1]))


def test_special_values_escape_and_survive():
    specials = np.array([0x7FC1, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x807F, 0x7F7F], np.uint16)
    w = np.full((2, 256), 0x3C00, np.uint16)                      # 1.0 in bf16... then the specials
    w[0, 5:15] = specials
    fr = F.encode(w)
    assert np.array_equal(F.decode(fr), w)
    assert {0xFF} <= set((fr.esc >> 8).tolist())                  # Inf/NaN fields (255) escape 1.0's window


def test_code_of_weight_4q_plus_b_is_in_byte_lane_b():
    # q = 0..5: the whole code in word q // 2 at bits 8b + 3(q % 2); q = 6, 7: bits 0..1 in word
    # 0 (q = 6) or 2 (q = 7) at 8b + 6, bit 2 in word 1 at 8b + q (words 0, 1: lo; 2: hi)
    codes = (np.arange(F.GROUP, dtype=np.uint8)[None] * 5 + 3) % 8
    lo, hi = F.pack_codes(codes)
    words = [int(lo[0, 0]), int(lo[0, 1]), int(hi[0])]
    for i in range(F.GROUP):
        q, b = divmod(i, 4)
        if q < 6:
            code = (words[q // 2] >> (8 * b + 3 * (q % 2))) & 7
        else:
            code = (words[2 * (q - 6)] >> (8 * b + 6)) & 3 | ((words[1] >> (8 * b + q)) & 1) << 2
        assert code == codes[0, i]
    assert np.array_equal(F.unpack_codes(lo, hi), codes)
    lo, hi = F.pack_codes(np.full((1, F.GROUP), 7, np.uint8))      # every bit of the three words is a code bit
    assert [int(lo[0, 0]), int(lo[0, 1]), int(hi[0])] == [0xFFFFFFFF] * 3


def test_base_is_the_smallest_window_start_covering_the_most():
    field = np.array([[10, 11, 12, 30, 31, 32, 33] + [20] * 0 + [31] * 121], np.uint8)
    valid = np.ones_like(field, bool)
    assert F.choose_bases(field, valid)[0] == 26                  # [26, 33] covers all 30..33
    tie = np.array([[5] * 64 + [50] * 64], np.uint8)
    assert F.choose_bases(tie, np.ones_like(tie, bool))[0] == 0    # both cover 64: the smallest b
    top = np.array([[255] * 128], np.uint8)                        # the highest window reaches 255
    assert F.choose_bases(top, np.ones_like(top, bool))[0] == F.MAX_BASE
    high = np.array([[250] * 100 + [255] * 28], np.uint8)
    assert F.choose_bases(high, np.ones_like(high, bool))[0] == F.MAX_BASE


def test_padding_never_escapes_and_is_not_decoded():
    w = words(make_tensor(torch.bfloat16, (3, 40), seed=1, kind="normal"))
    fr = F.encode(w)
    codes = F.unpack_codes(fr.lo.reshape(-1, 2), fr.hi.reshape(-1)).reshape(3, -1)
    assert not codes[:, 40:].any() and not fr.plane[:, 40:].any()
    assert F.decode(fr).shape == (3, 40)


def test_plane_bytes_cross_signs_within_pairs():
    # plane byte of weight i: bits 0..6 of w_i << 1 | the sign of w_(i ^ 1)
    w = np.array([[0x8001, 0x0002, 0xC07F, 0x4000, 0x8000]], np.uint16)
    fr = F.encode(w)
    assert fr.plane[0, :6].tolist() == [0x02, 0x05, 0xFE, 0x01, 0x00, 0x01]   # byte 5: padding, w_4's sign
    assert not fr.plane[0, 6:].any()
    assert np.array_equal(F.decode(fr), w)


def test_escape_starts_are_an_exclusive_prefix_over_blocks():
    w = words(make_tensor(torch.bfloat16, (4, 3000), seed=2, kind="mixed"))
    fr = F.encode(w)
    starts = fr.esc_start.reshape(-1)
    assert starts[0] == 0 and np.all(np.diff(starts) >= 0) and starts[-1] <= fr.esc.size
    counts = (fr.tile >> 8).astype(np.int64)
    assert counts.sum() == fr.esc.size
    first = np.cumsum(counts.reshape(-1)) - counts.reshape(-1)        # row-major: the tiles' runs follow on
    assert np.array_equal(F.tile_starts(fr).reshape(-1), first)


def test_escapes_are_listed_by_tile_in_position_order():
    # tile 0: weights 3 and 9 out of 1.0's window; tile 1 (cols 128..): weight 130
    w = np.full((1, 200), 0x3F80, np.uint16)                         # bf16 1.0: field 127
    w[0, 3], w[0, 9], w[0, 130] = 0x7F80, 0x0001, 0xC480             # +Inf (255), a subnormal (0), -1024 (137)
    fr = F.encode(w)
    assert (fr.tile & 0xFF).tolist() == [[120, 120]]                 # the smallest window holding 127
    assert (fr.tile >> 8).tolist() == [[2, 1]]
    assert fr.esc.tolist() == [3 | 255 << 8, 9 | 0 << 8, 2 | 137 << 8]
    codes = F.unpack_codes(fr.lo.reshape(-1, 2), fr.hi.reshape(-1)).reshape(1, -1)
    assert codes[0, 3] == codes[0, 9] == codes[0, 130] == 0          # an escape's code is 0
    assert np.array_equal(F.decode(fr), w)


def test_decode_refuses_entries_past_the_array_or_the_row():
    w = np.full((1, 64), 0x3F80, np.uint16)
    w[0, 5] = 0x7F80
    fr = F.encode(w)
    short = F.FixedRate(fr.rows, fr.cols, fr.dtype, fr.plane, fr.lo, fr.hi, fr.tile, fr.esc[:0], fr.esc_start)
    with pytest.raises(CodecError):
        F.decode(short)
    far = F.FixedRate(fr.rows, fr.cols, fr.dtype, fr.plane, fr.lo, fr.hi, fr.tile, fr.esc | 100, fr.esc_start)
    with pytest.raises(CodecError):                                  # position 101 of a 64-weight row (2 groups)
        F.decode(far)


def test_size_on_weights():
    w = words(make_tensor(torch.bfloat16, (256, 4096), seed=3, kind="normal"))
    assert F.encode(w).nbytes / w.nbytes < 0.71


def test_refuses_what_it_cannot_hold():
    with pytest.raises(CodecError):
        F.encode(np.zeros(10, np.uint16))
    with pytest.raises(CodecError):
        F.encode(np.zeros((2, 2), np.float32))
