"""Decode plans: one int64 descriptor row per float tensor, the only thing the host builds.

The C++ and CUDA decoders read each tensor's `exp` stream directory themselves (segment offsets,
word counts, tables) with bounds checks, so planning a 7B model costs one row per tensor, not a
Python pass over ~50 000 segments and ~100 000 tables. Column order: wcodec_constants.h DescField.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codec import errors
from codec.constants import CODEC_FLOAT
from codec.entries import TensorEntry

DESC_FIELDS = ("exp_off", "exp_len", "hi_off", "lo_off", "numel", "ctx_bits", "table_group",
               "dtype", "first_segment")
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
STATUS_TEXT = {1: "used more or fewer words than it holds", 2: "a lane did not end at L",
               3: "its directory points outside the stream", 4: "a frequency table is malformed"}


@dataclass(frozen=True)
class Plan:
    """A batch of tensors whose streams all lie in the byte range [start, end) of the archive."""

    start: int
    end: int
    float_entries: list[TensorEntry]
    desc: torch.Tensor                        # int64 [n_float, len(DESC_FIELDS)], CPU
    raw_entries: list[tuple[TensorEntry, int]]   # (entry, offset of its raw stream from start)

    @property
    def n_segments(self) -> int:
        return sum(e.params.n_segments for e in self.float_entries)


def _rel(entry: TensorEntry, role: str, start: int, end: int, path) -> int:
    rec = entry.streams[role]
    if rec["offset"] < start or rec["offset"] + rec["length"] > end:
        raise errors.HeaderError(path, f"tensor {entry.name!r}: stream {role} lies outside its batch")
    return rec["offset"] - start


def stream_range(entries: list[TensorEntry]) -> tuple[int, int]:
    """The smallest byte range holding every stream of `entries`."""
    recs = [r for e in entries for r in e.streams.values()]
    if not recs:
        return 0, 0
    return min(r["offset"] for r in recs), max(r["offset"] + r["length"] for r in recs)


def build(entries: list[TensorEntry], path=None, start: int | None = None, end: int | None = None) -> Plan:
    """Plan a batch; streams must lie in [start, end) (default: their smallest common range)."""
    if start is None or end is None:
        start, end = stream_range(entries)
    rows, floats, raws, first = [], [], [], 0
    for e in entries:
        if e.codec != CODEC_FLOAT:
            raws.append((e, _rel(e, "raw", start, end, path)))
            continue
        p = e.params
        rows.append([_rel(e, "exp", start, end, path), e.streams["exp"]["length"],
                     _rel(e, "hi", start, end, path),
                     _rel(e, "lo", start, end, path) if "lo" in e.streams else -1,
                     p.n, p.ctx_bits, p.table_group, DTYPE_CODES[e.dtype], first])
        floats.append(e)
        first += p.n_segments
    desc = torch.tensor(rows, dtype=torch.int64).reshape(-1, len(DESC_FIELDS))
    return Plan(start, end, floats, desc, raws)


def raise_on_status(plan: Plan, status: torch.Tensor, path) -> None:
    """Turn the decoders' per-segment status into the codec's typed error."""
    status = status.cpu()
    bad = torch.nonzero(status).flatten()
    if len(bad) == 0:
        return
    seg = int(bad[0])
    for e, row in zip(plan.float_entries, plan.desc.tolist()):
        first = row[DESC_FIELDS.index("first_segment")]
        if first <= seg < first + e.params.n_segments:
            code = int(status[seg])
            raise errors.CorruptStreamError(path, f"tensor {e.name!r}: segment {seg - first} "
                                                  f"{STATUS_TEXT.get(code, f'status {code}')}")
    raise errors.CorruptStreamError(path, f"segment {seg}: status {int(status[seg])}")
