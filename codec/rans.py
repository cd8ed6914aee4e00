"""Interleaved rANS over many independent segments, vectorised with NumPy across segments and lanes.

Read me first (the traps)
-------------------------
* rANS is LIFO: the encoder walks every segment BACKWARDS (last step first); the decoder walks
  forwards and gets the symbols in their natural order.
* Lane mapping: symbol j of a segment belongs to lane ``j % 32`` at step ``j // 32``. A warp
  decodes a segment with one lane per state; each step writes 32 consecutive symbols.
* Word order: at each step, after all lanes decoded one symbol, the lanes whose state fell below
  L pull one 16-bit word each, in increasing lane order (a warp does this with ballot + popc).
  The stream of a segment is therefore  [words of step 0][words of step 1]... each in lane order.
  The encoder emits step T-1 first, so it records per-step words and concatenates them forwards.
* Every lane's encoder starts at x = L, so every lane's decoder must end at exactly L, having used
  exactly the segment's words: that is the per-segment corruption check.
* Padded positions (segments shorter than the longest in a batch, partial last steps) use the
  identity table: x stays x, no word moves. No masks in the loops.

State maths (P = PROB_BITS, M = 2**P, L = 2**16):
    encode  x -> ((x // f) << P) + (x % f) + c          after emitting x & 0xFFFF while x >= f << (32-P)
    decode  x -> f * (x >> P) + (x & (M-1)) - c         then x = (x << 16) | word  while x < L
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .constants import LANES, PROB_BITS, PROB_SCALE, RANS_L, RENORM_BITS
from .tables import LUT_FREQ_SHIFT, LUT_SYM_SHIFT

_EMIT_SHIFT = 32 - PROB_BITS          # x >= f << (32 - P)  <=>  (x >> (32 - P)) >= f
_SLOT_MASK = np.uint32(PROB_SCALE - 1)

STATUS_OK = 0
STATUS_WORDS = 1                       # the segment used more or fewer words than it holds
STATUS_STATE = 2                       # a lane did not end at L


@dataclass(frozen=True)
class Layout:
    """Where the segments of a batch sit in the step-major arrays [steps, rows, 32]."""

    lengths: np.ndarray                # symbols per segment, caller order
    starts: np.ndarray                 # first symbol of each segment in the caller's concatenation
    rank: np.ndarray                   # row of each segment (longest segment first)
    active: np.ndarray                 # active[t] = rows that still have symbols at step t
    steps: int

    @property
    def rows(self) -> int:
        return len(self.lengths)


def plan(lengths: np.ndarray) -> Layout:
    """Lay out segments of the given lengths (concatenated in caller order) step-major."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    rank = np.empty(len(lengths), dtype=np.int64)
    rank[order] = np.arange(len(lengths))
    seg_steps = (lengths + LANES - 1) // LANES
    steps = int(seg_steps.max()) if len(lengths) else 0
    active = len(lengths) - np.searchsorted(np.sort(seg_steps), np.arange(steps), side="right")
    return Layout(lengths, np.cumsum(lengths) - lengths, rank, active.astype(np.int64), steps)


def to_step_major(layout: Layout, per_symbol: np.ndarray, pad) -> np.ndarray:
    """Caller-order symbols -> [steps, rows, 32]. Positions past a segment's end in its last
    step hold `pad` (a scalar, or one value per segment). Later steps of a row are never read
    (rows are sorted longest first and the loops slice the active prefix), so they stay unset."""
    out = np.empty((layout.steps, layout.rows, LANES), dtype=per_symbol.dtype)
    pads = np.broadcast_to(np.asarray(pad, dtype=per_symbol.dtype), layout.lengths.shape)
    for n, start, row, p in zip(layout.lengths.tolist(), layout.starts.tolist(),
                                layout.rank.tolist(), pads.tolist()):
        full = n // LANES
        out[:full, row, :] = per_symbol[start:start + full * LANES].reshape(full, LANES)
        if n % LANES:
            out[full, row, :n % LANES] = per_symbol[start + full * LANES:start + n]
            out[full, row, n % LANES:] = p
    return out


def from_step_major(layout: Layout, arr: np.ndarray) -> np.ndarray:
    """Inverse of to_step_major: [steps, rows, 32] -> caller-order symbols."""
    out = np.empty(int(layout.lengths.sum()), dtype=arr.dtype)
    for n, start, row in zip(layout.lengths.tolist(), layout.starts.tolist(), layout.rank.tolist()):
        full = n // LANES
        out[start:start + full * LANES] = arr[:full, row, :].reshape(-1)
        if n % LANES:
            out[start + full * LANES:start + n] = arr[full, row, :n % LANES]
    return out


def encode(layout: Layout, packed: np.ndarray):
    """Encode a batch. `packed`: each symbol's ``freq << 12 | cum`` under its own table
    (tables.pack_encode; u32, caller order). Returns (states [n_seg, 32] u32, words u16 concatenated in
    caller segment order, word counts per segment)."""
    fc_all = to_step_major(layout, packed, PROB_SCALE << PROB_BITS)     # pad: identity symbol
    words = np.empty((layout.steps, layout.rows, LANES), dtype=np.uint16)
    emitted = np.empty((layout.steps, layout.rows, LANES), dtype=bool)
    x = np.full((layout.rows, LANES), RANS_L, dtype=np.uint32)
    for t in range(layout.steps - 1, -1, -1):
        k = layout.active[t]
        xs, fc = x[:k], fc_all[t, :k]
        f = fc >> PROB_BITS
        emit = (xs >> _EMIT_SHIFT) >= f                            # x >= f << (32 - P)
        words[t, :k] = xs                                          # low 16 bits; kept where emit
        emitted[t, :k] = emit
        xs = xs >> (emit.view(np.uint8) * np.uint8(RENORM_BITS))
        q = (xs / f).astype(np.uint32)                             # exact: x < 2**32, f <= 2**12
        x[:k] = xs + q * (PROB_SCALE - f) + (fc & _SLOT_MASK)           # x = C(s, x) = (q << P) + x % f + c
    for t in range(layout.steps):                                  # rows past their end emit nothing
        emitted[t, layout.active[t]:] = False
    by_row = emitted.transpose(1, 0, 2)
    counts_by_row = by_row.sum(axis=(1, 2))
    flat = words.transpose(1, 0, 2)[by_row]                        # row, then step, then lane
    row_start = np.cumsum(counts_by_row) - counts_by_row
    pieces = [flat[row_start[r]:row_start[r] + counts_by_row[r]] for r in layout.rank]
    return x[layout.rank], np.concatenate(pieces) if pieces else flat, counts_by_row[layout.rank]


_LANE_PREFIX = ((np.uint64(1) << np.arange(1, LANES + 1, dtype=np.uint64)) - np.uint64(1)).astype(np.uint32)


class Decoded(NamedTuple):
    symbols: np.ndarray                # u8, caller order
    status: np.ndarray                 # per segment: STATUS_OK / STATUS_WORDS / STATUS_STATE
    entry_states: np.ndarray | None    # record_every = K: [segments, ceil(steps / K), 32] u32, the
                                       # states before steps 0, K, 2K, ... (zero past a segment's end)
    entry_words: np.ndarray | None     # [segments, ceil(steps / K)] words consumed before them


def decode(layout: Layout, states: np.ndarray, words: np.ndarray, word_start: np.ndarray,
           word_count: np.ndarray, seg_row: np.ndarray, sym_row: np.ndarray, pad_row: np.ndarray,
           lut: np.ndarray, *, end_states: np.ndarray | None = None, record_every: int = 0) -> Decoded:
    """Decode a batch with the packed LUT of tables.build_lut.

    Symbol j's LUT entry is ``lut[seg_row[seg] + sym_row[j] + slot]``: seg_row (per segment) is
    the segment's table set, sym_row (u16, per symbol) its context table within the set. Padding
    past a segment's end uses ``seg_row + pad_row[seg]``, which must be an identity table.
    `words` holds every segment's words, segment i at [word_start[i], word_start[i] + word_count[i]).
    A segment must end with its states equal to `end_states` ([segments, 32]; default all L) having
    used exactly word_count words. `record_every` = K > 0 also records the entry points before
    every K-th step (the resident index, codec/resident.py)."""
    row_all = to_step_major(layout, np.asarray(sym_row, dtype=np.uint16), pad_row)
    base = np.empty((layout.rows, 1), dtype=np.int64)
    base[layout.rank, 0] = seg_row
    sym_all = np.empty((layout.steps, layout.rows, LANES), dtype=np.uint8)
    x = np.empty((layout.rows, LANES), dtype=np.uint32)
    x[layout.rank] = states
    # Word 0 is a zero that every non-renormalising lane reads; a tail of zeros as long as a
    # segment could over-read keeps every read in bounds with no clip in the loop.
    padded = np.zeros(1 + len(words) + layout.steps * LANES, dtype=np.uint32)
    padded[1:1 + len(words)] = words
    if len(padded) >= 2**31:
        raise ValueError("a decode batch must hold fewer than 2**31 words")
    ptr = np.zeros((layout.rows, 1), dtype=np.int32)
    ptr[layout.rank, 0] = word_start
    n_entries = -(-layout.steps // record_every) if record_every else 0
    rec_x = np.zeros((layout.rows, n_entries, LANES), dtype=np.uint32)
    rec_p = np.zeros((layout.rows, n_entries), dtype=np.int64)
    for t in range(layout.steps):
        k = layout.active[t]
        if record_every and t % record_every == 0:                        # an entry point
            rec_x[:k, t // record_every] = x[:k]
            rec_p[:k, t // record_every] = ptr[:k, 0]
        xs = x[:k]
        v = np.take(lut, (base[:k] + row_all[t, :k]) + (xs & _SLOT_MASK), mode="wrap")
        sym_all[t, :k] = v >> LUT_SYM_SHIFT                           # (u8 keeps the symbol's bits)
        xs = ((v >> LUT_FREQ_SHIFT) + 1) * (xs >> PROB_BITS) + (v & _SLOT_MASK)        # x = D(x)
        need = xs < RANS_L
        mask = np.packbits(need, axis=1, bitorder="little").view("<u4")   # [k, 1]: bit l = lane l
        taken = np.bitwise_count(mask & _LANE_PREFIX)                     # words taken by lanes <= l
        pos = (ptr[:k] + taken) * need                                    # 1-based; 0 -> zero word
        x[:k] = (xs << (need.view(np.uint8) * np.uint8(RENORM_BITS))) | np.take(padded, pos, mode="wrap")
        ptr[:k] += taken[:, -1:]
    ptr = ptr[:, 0]
    used = ptr[layout.rank].astype(np.int64) - word_start
    status = np.where(used != word_count, STATUS_WORDS, STATUS_OK)
    end = RANS_L if end_states is None else end_states
    bad_state = (x[layout.rank] != end).any(axis=1)
    status = np.where((status == STATUS_OK) & bad_state, STATUS_STATE, status)
    if not record_every:
        return Decoded(from_step_major(layout, sym_all), status, None, None)
    seg_steps = (layout.lengths + LANES - 1) // LANES
    live = np.arange(n_entries)[None, :] * record_every < seg_steps[:, None]     # entries inside a segment
    rec_p = np.where(live, rec_p[layout.rank] - np.asarray(word_start, np.int64)[:, None], 0)
    return Decoded(from_step_major(layout, sym_all), status, rec_x[layout.rank] * live[..., None], rec_p)
