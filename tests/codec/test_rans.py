"""Tests of codec.rans: segment layout, encode/decode round trips, per-segment corruption status."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import rans, tables
from codec.constants import LANES, PROB_SCALE, RANS_L, SEGMENT_SYMBOLS

SEED = 20261121


def _tables(rng: np.random.Generator, n: int) -> np.ndarray:
    """n tables [n, 256]: a dense skewed one, a sparse one, then alternating."""
    out = np.zeros((n, 256), np.int64)
    for t in range(n):
        if t % 2 == 0:                                   # exponent-like: a narrow bell
            out[t] = np.bincount(np.clip(rng.normal(120 + 4 * t, 3, 20000).astype(int), 0, 255), minlength=256)
        else:                                            # a handful of symbols
            out[t, rng.choice(256, size=5, replace=False)] = rng.integers(1, 100, size=5)
    return tables.normalize(out)


def _sample(rng: np.random.Generator, freqs: np.ndarray, table_of: np.ndarray) -> np.ndarray:
    """A codable symbol for every position, drawn from its own table."""
    sym = np.zeros(len(table_of), np.uint8)
    for t, f in enumerate(freqs):
        where = np.flatnonzero(table_of == t)
        sym[where] = rng.choice(256, size=len(where), p=f / PROB_SCALE)
    return sym


def _encode(lengths, freqs: np.ndarray, table_of: np.ndarray, sym: np.ndarray):
    layout = rans.plan(np.asarray(lengths, np.int64))
    packed = tables.pack_encode(freqs)[table_of, sym]
    states, words, counts = rans.encode(layout, packed)
    return layout, states, words, counts


def _decode(layout: rans.Layout, states, words, counts, freqs: np.ndarray, table_of: np.ndarray,
            starts: np.ndarray | None = None):
    """rans.decode with one table set: `freqs` then an all-zero (identity) table for the padding."""
    n_seg, n_tab = layout.rows, len(freqs)
    lut = tables.build_lut(np.concatenate([freqs, np.zeros((1, 256), freqs.dtype)]))
    starts = np.cumsum(counts) - counts if starts is None else starts
    res = rans.decode(layout, states, words, starts, counts, np.zeros(n_seg, np.int64),
                      (table_of * PROB_SCALE).astype(np.uint16), np.full(n_seg, n_tab * PROB_SCALE, np.uint16),
                      lut)
    return res.symbols, res.status


def _case(lengths, n_tables: int = 3, seed: int = SEED):
    rng = np.random.default_rng(seed)
    freqs = _tables(rng, n_tables)
    table_of = rng.integers(0, n_tables, size=int(np.sum(lengths)))
    sym = _sample(rng, freqs, table_of)
    return (freqs, table_of, sym) + _encode(lengths, freqs, table_of, sym)


# --- layout ------------------------------------------------------------------------------------


def test_plan_orders_longest_first_and_counts_active_rows() -> None:
    layout = rans.plan(np.array([0, 5, 64, 33]))
    assert layout.steps == 2 and layout.rows == 4
    assert layout.starts.tolist() == [0, 0, 5, 69]
    assert layout.rank.tolist() == [3, 2, 0, 1]          # 64 > 33 > 5 > 0, ties stable
    assert layout.active.tolist() == [3, 2]               # step 0: 3 non-empty rows; step 1: 64 and 33


def test_plan_empty() -> None:
    layout = rans.plan(np.zeros(0, np.int64))
    assert layout.steps == 0 and layout.rows == 0
    states, words, counts = rans.encode(layout, np.zeros(0, np.uint32))
    assert states.shape == (0, LANES) and len(words) == 0 and len(counts) == 0


@settings(max_examples=30)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=6), st.integers(0, 2**32 - 1))
def test_step_major_round_trip(lengths: list[int], seed: int) -> None:
    layout = rans.plan(np.array(lengths, np.int64))
    values = np.random.default_rng(seed).integers(0, 2**16, size=sum(lengths)).astype(np.uint16)
    arr = rans.to_step_major(layout, values, 7)
    assert arr.shape == (layout.steps, layout.rows, LANES)
    assert np.array_equal(rans.from_step_major(layout, arr), values)
    for n, start, row in zip(lengths, layout.starts.tolist(), layout.rank.tolist()):
        for j in {0, n // 2, n - 1} if n else ():           # symbol j -> step j // 32, lane j % 32
            assert arr[j // LANES, row, j % LANES] == values[start + j]
        if n % LANES:
            assert (arr[n // LANES, row, n % LANES:] == 7).all()


# --- round trips -------------------------------------------------------------------------------

LENGTH_CASES = {
    "one": [1],
    "lane-1": [31],
    "one-step": [32],
    "lane+1": [33],
    "empty-segments": [0, 1, 0, 0],
    "mixed": [1, 31, 32, 33, 0, 1000],
    "almost-full": [4095 * LANES + 7],
    "full": [SEGMENT_SYMBOLS],
    "full-and-short": [SEGMENT_SYMBOLS, 33, 4095 * LANES + 7, 0, 1],
}


@pytest.mark.parametrize("lengths", list(LENGTH_CASES.values()), ids=list(LENGTH_CASES))
def test_round_trip(lengths: list[int]) -> None:
    freqs, table_of, sym, layout, states, words, counts = _case(lengths)
    assert states.shape == (len(lengths), LANES) and states.dtype == np.uint32
    assert (states >= RANS_L).all()                       # encoder states keep L <= x < 2**32
    assert words.dtype == np.uint16 and counts.sum() == len(words)
    for n, c, s in zip(lengths, counts, states):
        assert c <= n                                     # at most one word per symbol
        if n == 0:
            assert c == 0 and (s == RANS_L).all()
    out, status = _decode(layout, states, words, counts, freqs, table_of)
    assert out.dtype == np.uint8 and np.array_equal(out, sym)
    assert status.tolist() == [rans.STATUS_OK] * len(lengths)


def test_round_trip_all_zero_lengths() -> None:
    freqs, table_of, _, layout, states, words, counts = _case([0, 0])
    assert layout.steps == 0 and len(words) == 0 and (states == RANS_L).all()
    out, status = _decode(layout, states, words, counts, freqs, table_of)
    assert len(out) == 0 and status.tolist() == [0, 0]


def test_one_symbol_alphabet_emits_no_words() -> None:
    freqs = np.zeros((1, 256), np.uint32)
    freqs[0, 42] = PROB_SCALE
    lengths = [1, 33, 5000]
    table_of = np.zeros(sum(lengths), np.int64)
    sym = np.full(sum(lengths), 42, np.uint8)
    layout, states, words, counts = _encode(lengths, freqs, table_of, sym)
    assert len(words) == 0 and counts.tolist() == [0, 0, 0] and (states == RANS_L).all()
    out, status = _decode(layout, states, words, counts, freqs, table_of)
    assert np.array_equal(out, sym) and not status.any()


def test_uniform_table_codes_eight_bits_per_symbol() -> None:
    freqs = tables.normalize(np.ones((1, 256), np.int64))
    rng = np.random.default_rng(SEED)
    lengths = [4096]
    table_of = np.zeros(4096, np.int64)
    sym = rng.integers(0, 256, 4096).astype(np.uint8)
    layout, states, words, counts = _encode(lengths, freqs, table_of, sym)
    assert counts.tolist() == [2048]                      # 8 bits per symbol, 16 per word
    out, status = _decode(layout, states, words, counts, freqs, table_of)
    assert np.array_equal(out, sym) and not status.any()


# --- corruption status -------------------------------------------------------------------------

CORRUPT_LENGTHS = [3000, 2500, 4000]


def test_flipped_word_is_flagged_in_its_segment_only() -> None:
    freqs, table_of, _, layout, states, words, counts = _case(CORRUPT_LENGTHS)
    starts = np.cumsum(counts) - counts
    for seg in range(len(CORRUPT_LENGTHS)):
        for at in (0, int(counts[seg]) // 2, int(counts[seg]) - 1):
            bad = words.copy()
            bad[starts[seg] + at] ^= 0x0100
            _, status = _decode(layout, states, bad, counts, freqs, table_of)
            assert status[seg] in (rans.STATUS_STATE, rans.STATUS_WORDS)
            assert np.count_nonzero(status) == 1


def test_changed_state_is_flagged() -> None:
    freqs, table_of, _, layout, states, words, counts = _case(CORRUPT_LENGTHS)
    for seg, lane, delta in ((0, 0, 1), (1, 31, 1 << 20), (2, 7, 1 << 31)):
        bad = states.copy()
        bad[seg, lane] ^= np.uint32(delta)
        _, status = _decode(layout, bad, words, counts, freqs, table_of)
        assert status[seg] != rans.STATUS_OK and np.count_nonzero(status) == 1


def test_final_state_not_l_is_status_state() -> None:
    """A segment whose states are already below the encoder's output range ends off L."""
    freqs, table_of, _, layout, states, words, counts = _case([64])
    _, status = _decode(layout, np.full_like(states, RANS_L), words, counts, freqs, table_of)
    assert status[0] in (rans.STATUS_STATE, rans.STATUS_WORDS)
    one = np.zeros((1, 256), np.uint32)
    one[0, 0] = PROB_SCALE                                 # no words: only the state check can fire
    layout, states, words, counts = _encode([64], one, np.zeros(64, np.int64), np.zeros(64, np.uint8))
    _, status = _decode(layout, states + np.uint32(1), words, counts, one, np.zeros(64, np.int64))
    assert status.tolist() == [rans.STATUS_STATE]


def test_extra_word_is_status_words() -> None:
    freqs, table_of, _, layout, states, words, counts = _case([500])
    _, status = _decode(layout, states, np.append(words, np.uint16(0x1234)), counts + 1, freqs, table_of)
    assert status.tolist() == [rans.STATUS_WORDS]


def test_truncated_segment_words() -> None:
    """A segment that holds fewer words than it needs: reads stay in bounds, the segment is
    flagged, and its neighbours (whose words follow it) still decode."""
    freqs, table_of, _, layout, states, words, counts = _case(CORRUPT_LENGTHS)
    starts = np.cumsum(counts) - counts
    for seg in range(len(CORRUPT_LENGTHS)):
        for drop in (1, int(counts[seg]) // 2, int(counts[seg])):
            keep = np.ones(len(words), bool)
            keep[starts[seg] + counts[seg] - drop:starts[seg] + counts[seg]] = False
            short = counts.copy()
            short[seg] -= drop
            _, status = _decode(layout, states, words[keep], short, freqs, table_of)
            assert status[seg] != rans.STATUS_OK
            assert np.count_nonzero(status) == 1


def test_truncated_word_list_with_stale_offsets() -> None:
    """The word list is cut but the segment offsets/counts still describe the whole list (a
    caller bug or a lying directory): the decoder must not read out of bounds or raise."""
    freqs, table_of, _, layout, states, words, counts = _case(CORRUPT_LENGTHS)
    for cut in (0, 1, len(words) // 2, len(words) - 1):
        _, status = _decode(layout, states, words[:cut], counts, freqs, table_of)
        assert status[-1] != rans.STATUS_OK


@settings(max_examples=60)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=5), st.integers(0, 2**32 - 1),
       st.integers(0, 2000), st.booleans())
def test_decode_garbage_never_raises(lengths: list[int], seed: int, n_words: int, consistent: bool) -> None:
    rng = np.random.default_rng(seed)
    freqs = _tables(rng, 2)
    layout = rans.plan(np.array(lengths, np.int64))
    states = rng.integers(0, 2**32, size=(len(lengths), LANES), dtype=np.uint64).astype(np.uint32)
    words = rng.integers(0, 2**16, size=n_words).astype(np.uint16)
    if consistent:                                          # counts partition the word list
        cuts = np.sort(rng.integers(0, n_words + 1, size=len(lengths) - 1))
        counts = np.diff(np.concatenate([[0], cuts, [n_words]]))
        starts = None
    else:                                                   # offsets and counts may point anywhere
        counts = rng.integers(0, 3000, size=len(lengths))
        starts = rng.integers(0, 3000, size=len(lengths))
    table_of = rng.integers(0, 2, size=sum(lengths))
    out, status = _decode(layout, states, words, counts, freqs, table_of, starts)
    assert out.shape == (sum(lengths),) and out.dtype == np.uint8
    assert set(status.tolist()) <= {rans.STATUS_OK, rans.STATUS_WORDS, rans.STATUS_STATE}
