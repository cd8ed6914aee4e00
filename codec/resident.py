"""The resident index: entry points that let a coded tensor be decoded in small independent pieces.

Read me first (the traps)
-------------------------
* The index is NOT stored in the file. One full decode (which a load does anyway) records it, and
  it lives beside the compressed streams in memory (docs/FORMAT.md §3.5). The file stays v1.
* Why not shorter segments on disk: a segment restart costs 24 bits per lane (the flushed 32-bit
  state less the information it carries, measured: bench/experiments/segment_cost.py), so 256-step segments
  would raise the ratio of trained-like bf16 from 0.6652 to 0.6707. An entry point costs 33 bits
  per lane-piece (the state and 1/32 of a word count) but only in memory, and only where wanted.
* Pieces: with K = entry_steps (a power of two from 8 to SEGMENT_STEPS), every segment owns
  P = SEGMENT_STEPS // K pieces, piece p of a tensor being segment p // P, steps
  [sub * K, min((sub + 1) * K, steps of the segment)), sub = p % P. Pieces past a short last
  segment's end are empty: their entries are zero and never read.
* Entry p holds the 32 lane states before the piece's first step and the words of its segment
  consumed before it. A piece decodes from its entry and must end exactly at the next entry of
  its segment, or at L with all the segment's words used: every piece is checked, like a segment.
* A segment's first piece starts from the segment's own stored states, not from its entry: rANS
  decoders can resynchronise after a perturbed state, so a corrupt entry is caught by the piece
  that must END at it. With that, every entry a decoder reads is checked by another piece.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import floatcodec, planes, rans
from .constants import LANES, RANS_L, SEGMENT_STEPS, SEGMENT_SYMBOLS

ENTRY_STEPS = 256                      # default K: a 4096 x 4096 bf16 tensor -> 2048 pieces


def pieces_per_segment(entry_steps: int) -> int:
    if entry_steps < 8 or entry_steps > SEGMENT_STEPS or entry_steps & (entry_steps - 1):
        raise ValueError(f"entry_steps must be a power of two in [8, {SEGMENT_STEPS}], not {entry_steps}")
    return SEGMENT_STEPS // entry_steps


@dataclass
class Index:
    """Entry points of one tensor."""

    entry_steps: int
    states: np.ndarray                 # [pieces, 32] u32
    words: np.ndarray                  # [pieces] u32

    @property
    def n_pieces(self) -> int:
        return len(self.words)


Item = tuple[floatcodec.ParsedExp, planes.FloatLayout, np.ndarray]   # parsed exp, layout, hi plane


def build(items: list[Item], entry_steps: int = ENTRY_STEPS):
    """Decode a batch of tensors in full and record their indexes. Returns, per tensor,
    (rans.Decoded of its segments, Index)."""
    per = pieces_per_segment(entry_steps)
    out = []
    for res in floatcodec.decode_batch(items, record_every=entry_steps):
        n_seg, n_rec = res.entry_words.shape
        states = np.zeros((n_seg, per, LANES), np.uint32)
        words = np.zeros((n_seg, per), np.uint32)
        states[:, :n_rec], words[:, :n_rec] = res.entry_states, res.entry_words
        out.append((res, Index(entry_steps, states.reshape(-1, LANES), words.reshape(-1))))
    return out


@dataclass(frozen=True)
class Piece:
    """Where piece p of a tensor lies, and what it must end at."""

    segment: int
    first: int                         # first symbol of the tensor
    symbols: int
    end_entry: int | None              # the entry it must end at; None: L and all the segment's words


def piece(params: floatcodec.FloatParams, entry_steps: int, p: int) -> Piece:
    per = pieces_per_segment(entry_steps)
    seg, sub = divmod(p, per)
    seg_len = int(params.segment_lengths()[seg])
    seg_steps = -(-seg_len // LANES)
    t0, t1 = sub * entry_steps, min((sub + 1) * entry_steps, seg_steps)
    first = seg * SEGMENT_SYMBOLS + min(LANES * t0, seg_len)
    symbols = max(0, min(LANES * t1, seg_len) - LANES * t0)
    return Piece(seg, first, symbols, p + 1 if sub + 1 < per and t1 < seg_steps else None)


def decode_pieces(items: list[tuple[floatcodec.ParsedExp, planes.FloatLayout, np.ndarray, Index, np.ndarray]]):
    """Decode chosen pieces of several tensors (parsed exp, layout, hi plane, index, piece ids)
    from their entry points. Returns, per tensor, (symbols of its pieces in the order given,
    concatenated; status per piece)."""
    lut, seg_rows, sym_rows, pad_rows = floatcodec.batch_tables([it[:3] for it in items])
    lengths, states, ends, words, counts, rows, syms, pads = [], [], [], [], [], [], [], []
    for (parsed, _, _, index, ids), seg_row, sym_row, pad_row in zip(items, seg_rows, sym_rows, pad_rows):
        for p in np.asarray(ids, np.int64).tolist():
            pc = piece(parsed.params, index.entry_steps, p)
            seg_words = parsed.words[pc.segment]
            head = p % pieces_per_segment(index.entry_steps) == 0         # starts from the stream's states
            w0 = int(index.words[p]) if pc.symbols and not head else 0
            w1 = len(seg_words) if pc.end_entry is None else int(index.words[pc.end_entry])
            start = (parsed.states[pc.segment] if head else index.states[p]) if pc.symbols else \
                np.full(LANES, RANS_L, np.uint32)
            end = np.full(LANES, RANS_L, np.uint32) if pc.end_entry is None else index.states[pc.end_entry]
            lengths.append(pc.symbols)
            states.append(start)
            ends.append(end if pc.symbols else start)
            words.append(seg_words[min(w0, len(seg_words)):max(w0, min(w1, len(seg_words)))])
            counts.append(w1 - w0 if pc.symbols else 0)
            rows.append(seg_row[pc.segment])
            syms.append(sym_row[pc.first:pc.first + pc.symbols])
            pads.append(pad_row[pc.segment])
    sizes = np.array([len(w) for w in words], np.int64)
    res = rans.decode(rans.plan(np.array(lengths, np.int64)), np.array(states, np.uint32).reshape(-1, LANES),
                      np.concatenate(words) if words else np.zeros(0, np.uint16), np.cumsum(sizes) - sizes,
                      np.array(counts, np.int64), np.array(rows, np.int64),
                      np.concatenate(syms) if syms else np.zeros(0, np.uint16), np.array(pads, np.uint16), lut,
                      end_states=np.array(ends, np.uint32).reshape(-1, LANES))
    out, sym0, k = [], 0, 0
    for *_, ids in items:
        n_ids = len(ids)
        n_sym = int(sum(lengths[k:k + n_ids]))
        out.append((res.symbols[sym0:sym0 + n_sym], res.status[k:k + n_ids]))
        sym0, k = sym0 + n_sym, k + n_ids
    return out
