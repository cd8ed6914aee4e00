"""Decode plans: one int64 descriptor row per float tensor, the only thing the host builds.

The C++ and CUDA decoders read each tensor's `exp` stream directory themselves (segment offsets,
word counts, tables) with bounds checks, so planning a 7B model costs one row per tensor, not a
Python pass over ~50 000 segments and ~100 000 tables. Column order: wcodec_constants.h DescField.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from codec import errors
from codec.constants import CODEC_FLOAT, CODEC_RAW, SEGMENT_STEPS
from codec.entries import TensorEntry

DESC_FIELDS = ("exp_off", "exp_len", "hi_off", "lo_off", "numel", "ctx_bits", "table_group",
               "dtype", "first_segment")
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}       # decode_pieces' dtypes
BYTES_CODE = 3                                                  # a byte plane coded alone (decode_bytes)
STATUS_TEXT = {1: "used more or fewer words than it holds", 2: "a lane did not end where it must",
               3: "its directory points outside the stream", 4: "a frequency table is malformed"}


@dataclass(frozen=True)
class Plan:
    """A batch of tensors whose streams all lie in the byte range [start, end) of the archive."""

    start: int
    end: int
    float_entries: list[TensorEntry]
    desc: torch.Tensor                        # int64 [n_float, len(DESC_FIELDS)], CPU
    raw_entries: list[tuple[TensorEntry, int]]   # (entry, offset of its raw stream from start)
    # every other codec (fp8 floats, GGUF blocks: cuda_ext/quant.py): (entry, {role: offset from start})
    coded_entries: list[tuple[TensorEntry, dict[str, int]]] = ()

    @property
    def n_segments(self) -> int:
        return sum(e.params.n_segments for e in self.float_entries)

    @property
    def segment_span(self) -> int:
        """Segments that status and index buffers must cover: a plan made by select() keeps its
        tensors' places in its parent's."""
        first = DESC_FIELDS.index("first_segment")
        return max((row[first] + e.params.n_segments for e, row in zip(self.float_entries, self.desc.tolist())),
                   default=0)


def select(plan: Plan, names) -> Plan:
    """The tensors `names` of a plan, as a plan over the same data whose tensors keep their
    first_segment: it decodes with the parent's resident index (one tensor of a layer, say)."""
    names = set(names)
    keep = [i for i, e in enumerate(plan.float_entries) if e.name in names]
    return Plan(plan.start, plan.end, [plan.float_entries[i] for i in keep], plan.desc[keep].contiguous(),
                [(e, off) for e, off in plan.raw_entries if e.name in names],
                [(e, offs) for e, offs in plan.coded_entries if e.name in names])


def _rel(entry: TensorEntry, role: str, start: int, end: int, path) -> int:
    rec = entry.streams[role]
    if rec["offset"] < start or rec["offset"] + rec["length"] > end:
        raise errors.HeaderError(path, f"tensor {entry.name!r}: stream {role} lies outside its batch")
    return rec["offset"] - start


def layer_groups(entries: list[TensorEntry]) -> list[list[TensorEntry]]:
    """Consecutive entries of one layer (None: embeddings before, final norm after), in order: the
    batches a load reads and decodes together, each in its byte range (stream_range)."""
    return [list(g) for _, g in itertools.groupby(entries, key=lambda e: e.layer)]


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
    rows, floats, raws, coded, first = [], [], [], [], 0
    for e in entries:
        if e.codec == CODEC_RAW:
            raws.append((e, _rel(e, "raw", start, end, path)))
            continue
        if e.codec != CODEC_FLOAT or e.dtype not in DTYPE_CODES:
            coded.append((e, {role: _rel(e, role, start, end, path) for role in e.streams}))
            continue
        p = e.params
        rows.append([_rel(e, "exp", start, end, path), e.streams["exp"]["length"],
                     _rel(e, "hi", start, end, path),
                     _rel(e, "lo", start, end, path) if "lo" in e.streams else -1,
                     p.n, p.ctx_bits, p.table_group, DTYPE_CODES[e.dtype], first])
        floats.append(e)
        first += p.n_segments
    desc = torch.tensor(rows, dtype=torch.int64).reshape(-1, len(DESC_FIELDS))
    return Plan(start, end, floats, desc, raws, coded)


MODE_BULK, MODE_RECORD, MODE_INDEXED = 0, 1, 2      # wcodec_constants.h Mode
WARPS_PER_BLOCK = 4                                  # decode_float.cu kWarpsPerBlock
INDEXED_WARPS_PER_BLOCK = 16                         # decode_float.cu kIndexedWarpsPerBlock


def units_per_segment(mode: int, entry_steps: int) -> int:
    return SEGMENT_STEPS // entry_steps if mode == MODE_INDEXED else 1


def segment_span(plan: Plan) -> int:
    """The most segments one block may span (decode_float.cu: segment_span): blocks of whole
    segments must not straddle a table group (4, 8, 16 or the whole tensor)."""
    groups = [e.params.table_group for e in plan.float_entries if e.params.table_group < e.params.n_segments]
    return min((g & -g for g in groups), default=1 << 30)


def warps_per_block(mode: int, entry_steps: int, units: int, sms: int, span: int) -> int:
    """Warps of one kernel block for a launch of `units` units on a GPU of `sms` multiprocessors
    (decode_float.cu: warps_per_block): the larger of 16 and 8 whose blocks each lie in one segment
    or in whole segments of one table group (at most `span`), and still number one an SM or more;
    else 4."""
    per = units_per_segment(mode, entry_steps)
    for w in (INDEXED_WARPS_PER_BLOCK, INDEXED_WARPS_PER_BLOCK // 2):
        if (per % w == 0 or (w % per == 0 and w // per <= span)) and units >= w * sms:
            return w
    return WARPS_PER_BLOCK


def device_plan(plan: Plan, outputs: list[torch.Tensor], mode: int, entry_steps: int) -> torch.Tensor:
    """What the CUDA kernel reads, built once per (plan, outputs, mode): desc rows | the first
    block of each tensor | output pointers (int64, on the outputs' device). The caller keeps
    `outputs` alive as long as it launches with this plan."""
    per = units_per_segment(mode, entry_steps)
    device = outputs[0].device if outputs else torch.device("cpu")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    units = [e.params.n_segments * per for e in plan.float_entries]
    warps = warps_per_block(mode, entry_steps, sum(units), sms, segment_span(plan))
    blocks = [-(-u // warps) for u in units]
    firsts = [sum(blocks[:i]) for i in range(len(blocks))]
    host = torch.cat([plan.desc.reshape(-1), torch.tensor(firsts, dtype=torch.int64),
                      torch.tensor([o.data_ptr() for o in outputs], dtype=torch.int64)])
    return host.to(device) if device.type == "cuda" else host


def outputs(plan: Plan, device) -> list[torch.Tensor]:
    """Fresh, uninitialised outputs for a plan's float tensors, in plan order."""
    return [torch.empty(e.shape, dtype=e.torch_dtype, device=device) for e in plan.float_entries]


def buffers(plan: Plan, device, mode: int, entry_steps: int):
    """(status, entry_states, entry_words) sized for a plan: one status per unit, and in RECORD /
    INDEXED mode the resident index (int32; empty in BULK mode)."""
    per = SEGMENT_STEPS // entry_steps if mode != MODE_BULK else 0
    n = plan.segment_span
    return (torch.zeros(n * units_per_segment(mode, entry_steps), dtype=torch.int32, device=device),
            torch.zeros(n * per * 32, dtype=torch.int32, device=device),
            torch.zeros(n * per, dtype=torch.int32, device=device))


def raise_on_status(plan: Plan, status: torch.Tensor, path, per: int = 1) -> None:
    """Turn the decoders' status per segment (per piece: `per` pieces a segment) into the codec's
    typed error."""
    status = status.cpu()
    bad = torch.nonzero(status).flatten()
    if len(bad) == 0:
        return
    unit = int(bad[0])
    what = "segment" if per == 1 else "piece"
    for e, row in zip(plan.float_entries, plan.desc.tolist()):
        first = row[DESC_FIELDS.index("first_segment")] * per
        if first <= unit < first + e.params.n_segments * per:
            code = int(status[unit])
            raise errors.CorruptStreamError(path, f"tensor {e.name!r}: {what} {unit - first} "
                                                  f"{STATUS_TEXT.get(code, f'status {code}')}")
    raise errors.CorruptStreamError(path, f"{what} {unit}: status {int(status[unit])}")
