"""Tests of codec.tables: normalisation, serialisation, parsing and the decode lookup table."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import tables
from codec.constants import PROB_BITS, PROB_SCALE, TABLE_BITMAP_BYTES


def _assert_valid_table(counts: np.ndarray, freqs: np.ndarray) -> None:
    """The format's invariants: sum == M per used row, used symbols >= 1, unused all zero."""
    assert freqs.dtype == np.uint32 and freqs.shape == counts.shape
    c, f = counts.reshape(-1, 256), freqs.reshape(-1, 256).astype(np.int64)
    for row_c, row_f in zip(c, f):
        if row_c.sum() == 0:
            assert not row_f.any()
            continue
        assert row_f.sum() == PROB_SCALE
        assert np.array_equal(row_f > 0, row_c > 0)


@st.composite
def count_rows(draw) -> np.ndarray:
    """[rows, 256] counts: some rows empty, some single-symbol, some extremely skewed."""
    seed = draw(st.integers(0, 2**32 - 1))
    rows = draw(st.integers(1, 4))
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, 256), dtype=np.int64)
    for r in range(rows):
        kind = draw(st.sampled_from(["empty", "one", "sparse", "dense", "skewed"]))
        if kind == "one":
            out[r, rng.integers(256)] = rng.integers(1, 10**9)
        elif kind == "sparse":
            used = rng.choice(256, size=rng.integers(1, 256), replace=False)
            out[r, used] = rng.integers(1, 1000, size=len(used))
        elif kind == "dense":
            out[r] = rng.integers(1, 10**6, size=256)
        elif kind == "skewed":
            out[r] = rng.integers(0, 3, size=256)
            out[r, rng.integers(256)] = 10**12
    return out


# --- normalize ---------------------------------------------------------------------------------


@settings(max_examples=150)
@given(count_rows())
def test_normalize_invariants(counts: np.ndarray) -> None:
    before = counts.copy()
    _assert_valid_table(counts, tables.normalize(counts))
    assert np.array_equal(counts, before)           # the input is not modified


def test_normalize_single_symbol_gets_all_of_m() -> None:
    for s in (0, 7, 255):
        counts = np.zeros(256, np.int64)
        counts[s] = 1
        f = tables.normalize(counts)
        assert f[s] == PROB_SCALE and f.sum() == PROB_SCALE


def test_normalize_equiprobable_256() -> None:
    f = tables.normalize(np.full(256, 12345, np.int64))
    assert np.array_equal(f, np.full(256, PROB_SCALE // 256, np.uint32))


def test_normalize_unused_rows_stay_zero() -> None:
    counts = np.zeros((3, 2, 256), np.int64)
    counts[1, 0, 9] = 5
    counts[2, 1, :] = 1
    f = tables.normalize(counts)
    assert f.shape == counts.shape
    assert not f[0].any() and not f[1, 1].any() and not f[2, 0].any()
    assert f[1, 0, 9] == PROB_SCALE and f[2, 1].sum() == PROB_SCALE


@pytest.mark.parametrize("rare", [255, 200, 100])
def test_normalize_deficit_path(rare: int) -> None:
    """Many symbols seen once beside one giant count: rounding each rare symbol up to 1 overshoots
    M, so the deficit must be taken back from the frequent symbols without zeroing anybody."""
    counts = np.zeros(256, np.int64)
    counts[:rare] = 1
    counts[255] = 10**12
    naive = np.where(counts > 0, np.maximum(1, np.rint(counts * (PROB_SCALE / counts.sum()))), 0)
    assert naive.sum() > PROB_SCALE                # the test really reaches the deficit path
    f = tables.normalize(counts)
    _assert_valid_table(counts, f)
    assert f[255] == PROB_SCALE - rare


def test_normalize_deficit_spread_over_several_symbols() -> None:
    """200 singletons beside 56 equal heavy symbols (73 slots each): the deficit (192) is larger
    than any one heavy symbol can give (72), so it must be taken from several; all stay >= 1."""
    counts = np.ones(256, np.int64)
    counts[200:] = 10**9
    f = tables.normalize(counts)
    _assert_valid_table(counts, f)
    assert (f[:200] == 1).all()
    heavy = f[200:].astype(np.int64)
    assert (heavy >= 1).all() and np.count_nonzero(heavy < 73) >= 3


# --- serialize / parse -------------------------------------------------------------------------


@settings(max_examples=100)
@given(count_rows(), st.integers(0, 7))
def test_serialize_parse_round_trip(counts: np.ndarray, lead: int) -> None:
    freqs = tables.normalize(counts)
    sizes = tables.serialized_size(freqs)
    for f, size in zip(freqs, sizes):
        blob = tables.serialize(f)
        assert len(blob) == size and len(blob) % 4 == 0
        buf = np.frombuffer(b"\xee" * lead + blob + b"\xee" * 3, dtype=np.uint8)   # any offset
        parsed = tables.parse(buf, lead, lead + len(blob))
        assert isinstance(parsed, np.ndarray) and parsed.dtype == np.uint32
        assert np.array_equal(parsed, f)


def test_serialize_layout() -> None:
    f = np.zeros(256, np.uint32)
    f[[0, 33, 255]] = [1, 4000, 95]
    blob = tables.serialize(f)
    bitmap = np.frombuffer(blob[:TABLE_BITMAP_BYTES], "<u4")
    expected = np.zeros(8, np.uint32)
    expected[0], expected[1], expected[7] = 1, 1 << 1, 1 << 31     # bit s%32 of word s//32
    assert np.array_equal(bitmap, expected)
    assert blob[TABLE_BITMAP_BYTES:] == np.array([1, 4000, 95, 0], "<u2").tobytes()   # + 2 pad


def _blob(freqs: dict[int, int]) -> np.ndarray:
    f = np.zeros(256, np.uint32)
    for s, v in freqs.items():
        f[s] = v
    return np.frombuffer(tables.serialize(f), np.uint8).copy()


def test_parse_short_buffer() -> None:
    buf = _blob({3: PROB_SCALE})
    for end in range(TABLE_BITMAP_BYTES):
        assert isinstance(tables.parse(buf, 0, end), str)


def test_parse_frequencies_past_end() -> None:
    buf = _blob({s: 16 for s in range(256)})
    for end in (TABLE_BITMAP_BYTES, TABLE_BITMAP_BYTES + 1, len(buf) - 1):
        assert isinstance(tables.parse(buf, 0, end), str)


def test_parse_sum_wrong() -> None:
    buf = _blob({1: 2000, 2: 2096})
    body = buf[TABLE_BITMAP_BYTES:].view("<u2")
    body[0] += 1
    assert "sum" in tables.parse(buf, 0, len(buf))
    body[0] -= 2
    assert "sum" in tables.parse(buf, 0, len(buf))


def test_parse_present_symbol_with_zero_frequency() -> None:
    buf = _blob({1: 2048, 2: 2048})
    buf[TABLE_BITMAP_BYTES:].view("<u2")[:2] = [0, PROB_SCALE]         # sum still M
    assert "frequency 0" in tables.parse(buf, 0, len(buf))


def test_parse_sum_overflowing_u16_is_an_error() -> None:
    buf = _blob({s: 16 for s in range(256)})
    buf[TABLE_BITMAP_BYTES:].view("<u2")[:] = 0xFFFF
    assert isinstance(tables.parse(buf, 0, len(buf)), str)


def test_parse_empty_table_is_unused() -> None:
    buf = np.frombuffer(tables.serialize(np.zeros(256, np.uint32)), np.uint8)
    assert len(buf) == TABLE_BITMAP_BYTES
    f = tables.parse(buf, 0, len(buf))
    assert isinstance(f, np.ndarray) and not f.any()


# --- decode LUT --------------------------------------------------------------------------------


def _fields(entries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sym, freq, bias) of packed LUT entries, read with the module's documented shifts."""
    e = entries.astype(np.int64)
    return ((e >> tables.LUT_SYM_SHIFT) & 0xFF, ((e >> tables.LUT_FREQ_SHIFT) & tables.LUT_FIELD_MASK) + 1,
            e & tables.LUT_FIELD_MASK)


def test_lut_fields_do_not_overlap() -> None:
    fields = sorted([(0, PROB_BITS), (tables.LUT_SYM_SHIFT, 8), (tables.LUT_FREQ_SHIFT, PROB_BITS)])
    for (lo, width), (next_lo, _) in itertools.pairwise(fields):
        assert lo + width <= next_lo
    assert fields[-1][0] + fields[-1][1] <= 32


def _expected_lut_row(f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cum = np.cumsum(f) - f
    sym = np.empty(PROB_SCALE, np.int64)
    for s in np.flatnonzero(f):
        sym[cum[s]:cum[s] + f[s]] = s
    slot = np.arange(PROB_SCALE)
    return sym, f[sym], slot - cum[sym]


@settings(max_examples=40)
@given(count_rows())
def test_build_lut_decodes_every_slot(counts: np.ndarray) -> None:
    freqs = tables.normalize(counts).astype(np.int64)
    lut = tables.build_lut(freqs)
    assert lut.dtype == np.uint32 and lut.shape == (len(freqs) * PROB_SCALE,)
    for t, f in enumerate(freqs):
        if f.sum() == 0:                              # unused row: the identity
            f = np.zeros(256, np.int64)
            f[0] = PROB_SCALE
        sym, freq, bias = _fields(lut[t * PROB_SCALE:(t + 1) * PROB_SCALE])
        exp_sym, exp_freq, exp_bias = _expected_lut_row(f)
        assert np.array_equal(sym, exp_sym)
        assert np.array_equal(freq, exp_freq)
        assert np.array_equal(bias, exp_bias)


def test_build_lut_identity_table() -> None:
    lut = tables.build_lut(np.zeros((1, 256), np.uint32))           # an unused row is the identity
    assert lut.shape == (PROB_SCALE,)
    sym, freq, bias = _fields(lut)
    assert not sym.any() and (freq == PROB_SCALE).all()
    assert np.array_equal(bias, np.arange(PROB_SCALE))
    x = np.array([1 << 16, 123456789, (1 << 32) - 1], np.uint64)   # a decode step is a no-op
    v = lut[(x & tables.LUT_FIELD_MASK).astype(np.int64)].astype(np.uint64)
    freq = ((v >> np.uint64(tables.LUT_FREQ_SHIFT)) & np.uint64(tables.LUT_FIELD_MASK)) + np.uint64(1)
    step = freq * (x >> np.uint64(PROB_BITS)) + (v & np.uint64(tables.LUT_FIELD_MASK))   # x = D(x)
    assert np.array_equal(step, x)


def test_build_lut_single_symbol_table() -> None:
    f = np.zeros((1, 256), np.uint32)
    f[0, 200] = PROB_SCALE
    sym, freq, bias = _fields(tables.build_lut(f)[:PROB_SCALE])
    assert (sym == 200).all() and (freq == PROB_SCALE).all()
    assert np.array_equal(bias, np.arange(PROB_SCALE))


def test_pack_encode() -> None:
    f = tables.normalize(np.arange(256, dtype=np.int64) + 1)
    packed = tables.pack_encode(f)
    assert np.array_equal(packed >> PROB_BITS, f)
    assert np.array_equal(packed & tables.LUT_FIELD_MASK, (np.cumsum(f) - f) & tables.LUT_FIELD_MASK)
    assert np.array_equal(tables.pack_encode(f[None, None])[0, 0], packed)


def test_cost_bits_matches_definition() -> None:
    counts = np.zeros(256, np.int64)
    counts[[1, 2, 3]] = [6, 1, 1]
    f = tables.normalize(counts)
    expected = sum(c * (PROB_BITS - np.log2(f[s])) for s, c in zip([1, 2, 3], [6, 1, 1]))
    assert tables.cost_bits(counts, f) == pytest.approx(expected)
    one = np.zeros(256, np.int64)
    one[4] = 1000
    assert tables.cost_bits(one, tables.normalize(one)) == 0.0
