"""The lossless float codec: exponent plane rANS-coded with context tables, other bits raw.

A coded tensor has up to three streams: "exp" (the coded `sym` plane, layout below), "hi" (raw
u8 plane) and, for fp32, "lo" (raw u16 plane). Stream "exp", little-endian:

    u64 seg_offset[n_segments]       byte offset of segment i from the stream start (16-aligned)
    u32 seg_words[n_segments]        16-bit words in segment i
    u32 table_offset[n_tables + 1]   byte offset of table j; the last entry is the tables' end
    tables                           tables.serialize(), 4-aligned
    segments                         u32 state[32] | u16 word[seg_words[i]] | pad to 16

Segment i holds symbols [i * S, min(n, (i + 1) * S)), S = segment_symbols. Table set g serves
segments [g * G, (g + 1) * G), G = table_group; within a set, table c = context (planes.context).
So symbol j of the tensor uses table ((j // S) // G) * 2**ctx_bits + ctx[j].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import planes, rans, tables
from .constants import (LOG2_FRAC_BITS, MAX_CTX_BITS, MIN_CODED_ELEMENTS, PROB_BITS, PROB_SCALE, SEGMENT_ALIGN,
                        SEGMENT_SYMBOLS, STATE_BYTES, TABLE_GROUPS)

_SEGMENT_OVERHEAD_BITS = 8 * (STATE_BYTES + 12 + SEGMENT_ALIGN // 2)


@dataclass(frozen=True)
class FloatParams:
    n: int
    ctx_bits: int
    table_group: int
    segment_symbols: int = SEGMENT_SYMBOLS

    @property
    def n_segments(self) -> int:
        return -(-self.n // self.segment_symbols)

    @property
    def n_tables(self) -> int:
        return -(-self.n_segments // self.table_group) << self.ctx_bits

    def to_json(self) -> dict:
        return {"segment_symbols": self.segment_symbols, "ctx_bits": self.ctx_bits,
                "table_group": self.table_group}

    def segment_lengths(self) -> np.ndarray:
        lengths = np.full(self.n_segments, self.segment_symbols, dtype=np.int64)
        if self.n % self.segment_symbols:
            lengths[-1] = self.n % self.segment_symbols
        return lengths


@dataclass
class Prepared:
    """A float tensor split into planes, with its chosen parameters and tables."""

    layout: planes.FloatLayout
    params: FloatParams
    freqs: np.ndarray                  # [n_tables, 256]
    sym: np.ndarray | None             # None when a coder other than the reference prepared it
    hi: np.ndarray
    lo: np.ndarray | None
    source: object = None              # that coder's own handle on the plane (cuda_ext/encode.py)
    sums: dict[str, int] | None = None  # CRC32s that coder computed where the planes were: of its
                                        # input bytes ("source") and of the raw planes ("hi", "lo")


def _fine_counts(sym: np.ndarray, ctx: np.ndarray, n_segments: int) -> np.ndarray:
    """Histogram [n_segments, 2**MAX_CTX_BITS, 256] of symbols by segment and full context."""
    key = (ctx.astype(np.uint16) << 8) | sym
    out = np.empty((n_segments, (1 << MAX_CTX_BITS) * 256), dtype=np.int64)
    for i in range(n_segments):
        out[i] = np.bincount(key[i * SEGMENT_SYMBOLS:(i + 1) * SEGMENT_SYMBOLS], minlength=out.shape[1])
    return out.reshape(n_segments, 1 << MAX_CTX_BITS, 256)


def _grouped(fine: np.ndarray, ctx_bits: int, group: int) -> np.ndarray:
    """Fine counts -> [n_tables, 256] for a ctx_bits / table_group choice."""
    n_seg = fine.shape[0]
    by_ctx = fine.reshape(n_seg, 1 << ctx_bits, -1, 256).sum(axis=2)
    n_sets = -(-n_seg // group)
    padded = np.zeros((n_sets * group,) + by_ctx.shape[1:], dtype=by_ctx.dtype)
    padded[:n_seg] = by_ctx
    return padded.reshape(n_sets, group, 1 << ctx_bits, 256).sum(axis=1).reshape(-1, 256)


def _cost_fixed(counts: np.ndarray) -> tuple[int, np.ndarray]:
    """Coded size of the tables' symbols plus the tables and their offsets, fixed point."""
    freqs = tables.normalize(counts)
    table_bits = 8 * (int(tables.serialized_size(freqs).sum()) + 4 * (len(freqs) + 1))
    return tables.cost_fixed(counts, freqs) + (table_bits << LOG2_FRAC_BITS), freqs


def prepare(layout: planes.FloatLayout, u: np.ndarray) -> Prepared | None:
    """Split a tensor, pick the cheapest context/table grouping; None if raw storage is cheaper."""
    n = len(u)
    if n < MIN_CODED_ELEMENTS:
        return None
    sym, hi, lo = planes.split(layout, u)
    if hi is None:                                 # the whole element is the symbol (fp8)
        return prepare_bytes(sym, layout)
    fine = _fine_counts(sym, planes.context(layout, hi, MAX_CTX_BITS), -(-n // SEGMENT_SYMBOLS))
    best = _cheapest(fine, n, MAX_CTX_BITS)
    return None if best is None else Prepared(layout, best[0], best[1], sym, hi, lo)


def prepare_bytes(sym: np.ndarray, layout: planes.FloatLayout | None = None) -> Prepared | None:
    """A plane of byte symbols with no raw plane beside it (fp8 weights, GGUF block planes): coded
    with ctx_bits 0, in the exp-stream layout. None if storing the bytes raw is cheaper."""
    n = len(sym)
    if n < MIN_CODED_ELEMENTS:
        return None
    fine = _fine_counts(sym, np.zeros(n, dtype=np.uint8), -(-n // SEGMENT_SYMBOLS))
    best = _cheapest(fine, n, 0)
    return None if best is None else Prepared(layout, best[0], best[1], sym, None, None)


def _cheapest(fine: np.ndarray, n: int, max_ctx_bits: int) -> tuple[FloatParams, np.ndarray] | None:
    """The (params, tables) of least exact coded size, tables included; None if raw is cheaper."""
    n_seg = fine.shape[0]
    groups = sorted({min(g, n_seg) for g in TABLE_GROUPS} | {n_seg})
    best = None
    for ctx_bits in range(max_ctx_bits + 1):
        for group in groups:
            cost, freqs = _cost_fixed(_grouped(fine, ctx_bits, group))
            if best is None or cost < best[0]:
                best = (cost, FloatParams(n, ctx_bits, group), freqs)
    cost, params, freqs = best
    if cost + ((n_seg * _SEGMENT_OVERHEAD_BITS) << LOG2_FRAC_BITS) >= (8 * n) << LOG2_FRAC_BITS:
        return None
    return params, freqs


def _contexts(layout: planes.FloatLayout | None, hi: np.ndarray | None, p: FloatParams) -> np.ndarray:
    """Each symbol's context table within its set; all 0 for a plane coded alone (hi is None)."""
    if p.ctx_bits == 0:
        return np.zeros(p.n, dtype=np.uint8)
    return planes.context(layout, hi, p.ctx_bits)


def _directory_size(p: FloatParams) -> int:
    return 12 * p.n_segments + 4 * (p.n_tables + 1)


def min_stream_bytes(p: FloatParams) -> int:
    """The fewest bytes an exp stream of these params can hold: its directory, and each segment's
    states (segments never overlap). A header whose shape claims more symbols than its stream can
    code is refused on this before any output is allocated."""
    return _directory_size(p) + p.n_segments * STATE_BYTES


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def encode_batch(batch: list[Prepared]) -> list[bytes]:
    """rANS-encode the exp planes of several tensors in one vectorised pass."""
    if not batch:
        return []
    packed = np.concatenate([_packed_symbols(p) for p in batch])
    layout = rans.plan(np.concatenate([p.params.segment_lengths() for p in batch]))
    states, words, counts = rans.encode(layout, packed)
    out, seg0, word0 = [], 0, 0
    for p in batch:
        n_seg = p.params.n_segments
        seg_counts = counts[seg0:seg0 + n_seg]
        n_words = int(seg_counts.sum())
        out.append(_assemble(p, states[seg0:seg0 + n_seg], words[word0:word0 + n_words], seg_counts))
        seg0, word0 = seg0 + n_seg, word0 + n_words
    return out


def _packed_symbols(p: Prepared) -> np.ndarray:
    """Each symbol's packed ``freq << 12 | cum`` under its own table (context within its set)."""
    key = (_contexts(p.layout, p.hi, p.params).astype(np.uint16) << 8) | p.sym
    sets = tables.pack_encode(p.freqs).reshape(-1, (1 << p.params.ctx_bits) * 256)
    span = p.params.table_group * p.params.segment_symbols
    out = np.empty(p.params.n, dtype=np.uint32)
    for g, entries in enumerate(sets):
        np.take(entries, key[g * span:(g + 1) * span], out=out[g * span:(g + 1) * span])
    return out


def _assemble(p: Prepared, states: np.ndarray, words: np.ndarray, counts: np.ndarray) -> bytes:
    table_blobs = [tables.serialize(f) for f in p.freqs]
    table_off = _directory_size(p.params) + np.cumsum([0] + [len(b) for b in table_blobs])
    seg_size = np.array([_align(STATE_BYTES + 2 * int(c), SEGMENT_ALIGN) for c in counts], np.int64)
    seg_off = _align(int(table_off[-1]), SEGMENT_ALIGN) + np.cumsum(seg_size) - seg_size
    buf = np.zeros(int(seg_off[-1] + seg_size[-1]), dtype=np.uint8)
    buf[:8 * len(seg_off)] = seg_off.astype("<u8").view(np.uint8)
    buf[8 * len(seg_off):12 * len(seg_off)] = counts.astype("<u4").view(np.uint8)
    buf[12 * len(seg_off):_directory_size(p.params)] = table_off.astype("<u4").view(np.uint8)
    buf[table_off[0]:table_off[-1]] = np.frombuffer(b"".join(table_blobs), np.uint8)
    word0 = 0
    for i, off in enumerate(seg_off.tolist()):
        buf[off:off + STATE_BYTES] = states[i].astype("<u4").view(np.uint8)
        c = int(counts[i])
        buf[off + STATE_BYTES:off + STATE_BYTES + 2 * c] = words[word0:word0 + c].astype("<u2").view(np.uint8)
        word0 += c
    return buf.tobytes()


class ReferenceCoder:
    """The plane coder of codec/encode.py: prepare a plane, then encode a batch of them. This one
    is the NumPy reference (the specification); cuda_ext.encode.coder() gives the extension's
    twins, which produce the same bytes. `threaded`: the coder spreads its own work over threads
    (else the encoder runs it in worker processes)."""

    threaded = False
    buffers = None          # host buffers the reader fills (cuda_ext's CUDA coder: pinned); None: its own

    def prepare(self, layout: planes.FloatLayout, u: np.ndarray) -> Prepared | None:
        return prepare(layout, u)

    def prepare_bytes(self, sym: np.ndarray, layout: planes.FloatLayout | None = None) -> Prepared | None:
        return prepare_bytes(sym, layout)

    def prepare_many(self, items: list[tuple[planes.FloatLayout, np.ndarray]]) -> list[Prepared | None]:
        """prepare() of each (layout, elements): a batched coder prepares them in one call."""
        return [self.prepare(layout, u) for layout, u in items]

    def encode_batch(self, batch: list[Prepared]) -> list[bytes]:
        return encode_batch(batch)

    def stage(self, data: list[np.ndarray]) -> None:
        """Where a coder copies planes to its device ahead of prepare_many (cuda_ext/encode.py):
        the reading thread calls it with a batch's float tensors. Nothing to copy here."""


REFERENCE = ReferenceCoder()


class StreamFault(Exception):
    """An exp stream is internally inconsistent; the archive layer names the file and tensor.
    `table` tells a malformed frequency table from a directory that points astray."""

    def __init__(self, what: str, table: bool = False):
        super().__init__(what)
        self.table = table


@dataclass
class ParsedExp:
    params: FloatParams
    freqs: np.ndarray                  # [n_tables, 256]
    states: np.ndarray                 # [n_segments, 32] u32
    words: list[np.ndarray]            # per segment, u16 views into the stream


def parse_exp(buf: np.ndarray, params: FloatParams) -> ParsedExp:
    """Parse and bounds-check an exp stream (uint8 array). Raises StreamFault."""
    n_seg, n_tab, size = params.n_segments, params.n_tables, len(buf)
    dir_size = _directory_size(params)
    if size < dir_size:
        raise StreamFault(f"exp stream of {size} bytes is shorter than its {dir_size}-byte directory")
    seg_off = buf[:8 * n_seg].view("<u8").astype(np.uint64)
    seg_words = buf[8 * n_seg:12 * n_seg].view("<u4").astype(np.int64)
    tab_off = buf[12 * n_seg:dir_size].view("<u4").astype(np.int64)
    if tab_off[0] != dir_size or np.any(np.diff(tab_off) < 0) or tab_off[-1] > size:
        raise StreamFault("table offsets are out of order or out of the stream")
    freqs = np.zeros((n_tab, 256), dtype=np.uint32)
    for j in range(n_tab):
        f = tables.parse(buf, int(tab_off[j]), int(tab_off[j + 1]))
        if isinstance(f, str):
            raise StreamFault(f"table {j}: {f}", table=True)
        freqs[j] = f
    _check_segments(seg_off, seg_words, int(tab_off[-1]), size)
    off = seg_off.astype(np.int64)
    states = buf[off[:, None] + np.arange(STATE_BYTES)].reshape(n_seg, -1).view("<u4").reshape(n_seg, 32)
    words = [buf[o + STATE_BYTES:o + STATE_BYTES + 2 * c].view("<u2")
             for o, c in zip(off.tolist(), seg_words.tolist())]
    return ParsedExp(params, freqs, states.astype(np.uint32), words)


def _check_segments(seg_off: np.ndarray, seg_words: np.ndarray, tables_end: int, size: int) -> None:
    if np.any(seg_off > np.uint64(size)) or np.any(seg_off % np.uint64(SEGMENT_ALIGN)):
        raise StreamFault("a segment offset is unaligned or past the stream's end")
    start = seg_off.astype(np.int64)
    end = start + STATE_BYTES + 2 * seg_words
    if start[0] < tables_end or end.max() > size or np.any(start[1:] < end[:-1]):
        raise StreamFault("segments overlap, overlap the tables, or run past the stream's end")


def batch_tables(items: list[tuple[ParsedExp, planes.FloatLayout, np.ndarray]]):
    """One LUT for a batch of tensors (parsed stream, layout, hi plane), and per tensor the LUT row
    of each segment's table set, of each symbol's context table, and of each set's identity table."""
    tables_parts, seg_rows, sym_rows, pad_rows, first = [], [], [], [], 0
    for parsed, layout, hi in items:
        p = parsed.params
        n_ctx = 1 << p.ctx_bits
        sets = parsed.freqs.reshape(-1, n_ctx, 256)
        # each set is followed by an all-zero table, which build_lut makes the set's identity
        tables_parts.append(np.concatenate([sets, np.zeros((len(sets), 1, 256), sets.dtype)], axis=1))
        set_of_seg = np.arange(p.n_segments, dtype=np.int64) // p.table_group
        seg_rows.append((first + set_of_seg * (n_ctx + 1)) * PROB_SCALE)
        sym_rows.append(_contexts(layout, hi, p).astype(np.uint16) * np.uint16(PROB_SCALE))
        pad_rows.append(np.full(p.n_segments, n_ctx * PROB_SCALE, dtype=np.uint16))
        first += len(sets) * (n_ctx + 1)
    lut = tables.build_lut(np.concatenate([t.reshape(-1, 256) for t in tables_parts]))
    return lut, seg_rows, sym_rows, pad_rows


def decode_batch(items: list[tuple[ParsedExp, planes.FloatLayout, np.ndarray]], record_every: int = 0):
    """Decode the exp planes of several tensors (parsed stream, layout, hi plane) in one pass.
    Returns, per tensor, rans.Decoded for its segments (with entry points every `record_every`
    steps when > 0: codec/resident.py)."""
    lut, seg_rows, sym_rows, pad_rows = batch_tables(items)
    seg_words = [w for p, _, _ in items for w in p.words]
    counts = np.array([len(w) for w in seg_words], dtype=np.int64)
    res = rans.decode(rans.plan(np.concatenate([p.params.segment_lengths() for p, _, _ in items])),
                      np.concatenate([p.states for p, _, _ in items]),
                      np.concatenate(seg_words) if seg_words else np.zeros(0, np.uint16),
                      np.cumsum(counts) - counts, counts, np.concatenate(seg_rows),
                      np.concatenate(sym_rows), np.concatenate(pad_rows), lut, record_every=record_every)
    out, sym0, seg0 = [], 0, 0
    for parsed, _, _ in items:
        n, n_seg = parsed.params.n, parsed.params.n_segments
        segs = slice(seg0, seg0 + n_seg)
        out.append(rans.Decoded(res.symbols[sym0:sym0 + n], res.status[segs],
                                None if res.entry_states is None else res.entry_states[segs],
                                None if res.entry_words is None else res.entry_words[segs]))
        sym0, seg0 = sym0 + n, seg0 + n_seg
    return out
