"""The extension's side of the codec table for the codecs that decode_pieces does not decode:
fp8 floats (whole byte coded), GGUF blocks and int8. Two steps, the same on every device:

    decode_bytes        every coded byte plane of the plan, in one launch (one status per segment)
    FINISH[codec]       the planes -> the tensor: fp8 decodes straight into its output; int8
                        residuals, tile modes and scales -> reconstruct_int8; GGUF planes (decoded
                        ones, raw ones read in place from `data`) -> dequantize_blocks, one call
                        for all the plan's tensors of one block type and dtype; or, in
                        compressed-resident mode (keep_blocks), the planes kept as QuantBlocks,
                        whose rows dequantize_rows / gather_rows dequantize when a forward needs them

Ops: the C++ twin (or CUDA kernels) when the extension has them for data's device, else the
NumPy reference in cuda_ext/ops.py. On a CUDA device whose build lacks the kernels, the planes
are decoded on the CPU and the tensors copied over.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codec import errors
from codec.codecs import GGUFParams
from codec.gguf_blocks import BlockType
from codec.constants import CODEC_FLOAT, CODEC_GGUF, CODEC_INT8
from codec.int8 import MODES
from codec.entries import TensorEntry

from . import ops
from .plan import BYTES_CODE, DESC_FIELDS, STATUS_TEXT, Plan


@dataclass(frozen=True)
class BytePlane:
    entry: TensorEntry
    role: str
    first_segment: int
    n_segments: int


def byte_planes(p: Plan) -> tuple[list[BytePlane], torch.Tensor]:
    """Every coded stream of the plan's coded entries, and their descriptor rows (DESC_FIELDS)."""
    planes, rows, first = [], [], 0
    for e, offsets in p.coded_entries:
        for role, fp in e.codec_row.coded(e.dtype, e.params).items():
            row = {"exp_off": offsets[role], "exp_len": e.streams[role]["length"], "hi_off": -1, "lo_off": -1,
                   "numel": fp.n, "ctx_bits": 0, "table_group": fp.table_group, "dtype": BYTES_CODE,
                   "first_segment": first}
            rows.append([row[f] for f in DESC_FIELDS])
            planes.append(BytePlane(e, role, first, fp.n_segments))
            first += fp.n_segments
    return planes, torch.tensor(rows, dtype=torch.int64).reshape(-1, len(DESC_FIELDS))


@dataclass
class QuantBlocks:
    """A GGUF tensor kept as its blocks on a device (compressed-resident mode): its planes in
    codec/gguf_blocks.py order, each uint8 [rows x blocks a row x the plane's width], row after
    row; whole rows dequantize alone (`rows`, `dequantize_rows`) or gathered (`gather_rows`)."""

    block: BlockType
    planes: list[torch.Tensor]
    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)


def _row_bytes(block: BlockType, cols: int) -> list[int]:
    """Bytes of one row in each plane."""
    return [cols // block.block_size * block.plane_width(name) for name in block.plane_names]


def rows(block: BlockType, planes: list[torch.Tensor], cols: int, start: int, stop: int) -> list[torch.Tensor]:
    """The planes of rows [start, stop): views, no copy."""
    return [p[start * n:stop * n] for p, n in zip(planes, _row_bytes(block, cols))]


def _dequantizer(device: torch.device):
    """dequantize_blocks for `device`, resolved once a device type (a forward calls it per Linear)."""
    run = _DEQUANTIZERS.get(device.type)
    if run is None:
        run = _DEQUANTIZERS[device.type] = _ops(device).dequantize_blocks
    return run


_DEQUANTIZERS: dict[str, object] = {}


def dequantize_rows(block: BlockType, planes: list[torch.Tensor], out: torch.Tensor, start: int = 0) -> None:
    """Rows [start, start + R) of the tensor -> out [R, cols] (contiguous, the tensor's dtype)."""
    _dequantizer(out.device)(rows(block, planes, out.shape[1], start, start + out.shape[0]), block.code, [out])


def gather_rows(block: BlockType, planes: list[torch.Tensor], ids: torch.Tensor, out: torch.Tensor) -> None:
    """Rows `ids` [N] of the tensor -> out [N, cols] (llama.cpp's get_rows): only those rows'
    blocks are gathered and dequantized."""
    picked = [p.view(-1, n).index_select(0, ids).view(-1) for p, n in zip(planes, _row_bytes(block, out.shape[1]))]
    _dequantizer(out.device)(picked, block.code, [out])


@dataclass(frozen=True)
class Ops:
    decode_bytes: object
    dequantize_blocks: object
    reconstruct_int8: object


def _ops(device: torch.device) -> Ops:
    """The quantized codecs' ops for a device: the extension's, or the NumPy reference."""
    from .build import ensure_loaded
    if ensure_loaded().cpp and ops.has_quant_ops(device.type):
        return Ops(ops.decode_bytes, ops.dequantize_blocks, ops.reconstruct_int8)
    return Ops(ops.reference_decode_bytes, ops.reference_dequantize_blocks, ops.reference_reconstruct_int8)


def _raise_on_status(planes: list[BytePlane], status: torch.Tensor, path) -> None:
    bad = torch.nonzero(status.cpu()).flatten()
    if len(bad) == 0:
        return
    seg = int(bad[0])
    plane = next(pl for pl in planes if pl.first_segment <= seg < pl.first_segment + pl.n_segments)
    code = int(status[seg])
    raise errors.CorruptStreamError(path, f"tensor {plane.entry.name!r}: stream {plane.role}: segment "
                                          f"{seg - plane.first_segment} {STATUS_TEXT.get(code, f'status {code}')}")


def _stream(e: TensorEntry, role: str, offsets, data: torch.Tensor, decoded) -> torch.Tensor:
    """A plane: decoded by decode_bytes, or read raw in place from `data`."""
    return decoded[role] if role in decoded else data[offsets[role]:offsets[role] + e.streams[role]["length"]]


def _fp8(e: TensorEntry, offsets, data, decoded, run: Ops, path) -> torch.Tensor:
    return decoded["exp"]


def _kept(group: list, data, by_entry, run: Ops) -> dict[str, QuantBlocks]:
    """GGUF tensors kept as their blocks: the decoded planes, and copies of the raw ones (`data`
    is a load's staging buffer)."""
    out = {}
    for e, offsets in group:
        decoded = by_entry.get(e.name, {})
        planes = [decoded[role] if role in decoded else _stream(e, role, offsets, data, decoded).clone()
                  for role in e.params.block.plane_names]
        out[e.name] = QuantBlocks(e.params.block, planes, tuple(e.shape), e.torch_dtype)
    return out


def _gguf(group: list, data, by_entry, run: Ops) -> dict[str, torch.Tensor]:
    """GGUF tensors of one block type and dtype: one dequantize_blocks call."""
    params: GGUFParams = group[0][0].params
    outs = [torch.empty(e.shape, dtype=e.torch_dtype, device=data.device) for e, _ in group]
    run.dequantize_blocks([_stream(e, role, offsets, data, by_entry.get(e.name, {}))
                           for e, offsets in group for role in params.block.plane_names], params.block.code, outs)
    return {e.name: o for (e, _), o in zip(group, outs)}


def _int8(e: TensorEntry, offsets, data, decoded, run: Ops, path) -> torch.Tensor:
    modes = _stream(e, "modes", offsets, data, decoded)
    if modes.numel() and int(modes.max()) >= len(MODES):
        raise errors.CorruptStreamError(path, f"tensor {e.name!r}: a tile mode is {int(modes.max())}: "
                                              f"there are {len(MODES)}")
    out = torch.empty(e.shape, dtype=e.torch_dtype, device=data.device)
    run.reconstruct_int8(_stream(e, "resid", offsets, data, decoded), modes,
                         _stream(e, "scales", offsets, data, decoded).view(torch.float32), out)
    return out


FINISH = {CODEC_FLOAT: _fp8, CODEC_INT8: _int8}     # codec -> its planes to the tensor (GGUF: _gguf, by group)


def decode(p: Plan, data: torch.Tensor, path=None, keep_blocks: bool = False) -> dict[str, torch.Tensor]:
    """Decode the plan's coded entries from `data` (the archive bytes [p.start, p.end), on the
    target device). Corrupt streams raise CorruptStreamError naming the tensor, stream and segment.
    `keep_blocks`: GGUF tensors come back as QuantBlocks, their blocks undequantized."""
    if not p.coded_entries:
        return {}
    device, run = data.device, _ops(data.device)
    if device.type == "cuda" and run.decode_bytes is ops.reference_decode_bytes:
        return {k: v.to(device) for k, v in decode(p, data.cpu(), path, keep_blocks).items()}
    planes, desc = byte_planes(p)
    numel = DESC_FIELDS.index("numel")
    outputs = [torch.empty(pl.entry.shape, dtype=pl.entry.torch_dtype, device=device) if pl.entry.codec == CODEC_FLOAT
               else torch.empty(row[numel], dtype=torch.uint8, device=device)     # fp8: straight into the tensor
               for pl, row in zip(planes, desc.tolist())]
    status = torch.zeros(sum(pl.n_segments for pl in planes), dtype=torch.int32, device=device)
    if planes:
        run.decode_bytes(data, desc, [o.reshape(-1) for o in outputs], status)
        _raise_on_status(planes, status, path)
    by_entry: dict[str, dict[str, torch.Tensor]] = {}
    for pl, o in zip(planes, outputs):
        by_entry.setdefault(pl.entry.name, {})[pl.role] = o
    done, groups = {}, {}
    for e, offsets in p.coded_entries:
        if e.codec == CODEC_GGUF:
            groups.setdefault((e.params.block.code, e.torch_dtype), []).append((e, offsets))
        else:
            done[e.name] = FINISH[e.codec](e, offsets, data, by_entry.get(e.name, {}), run, path)
    for group in groups.values():
        done.update((_kept if keep_blocks else _gguf)(group, data, by_entry, run))
    return {e.name: done[e.name] for e, _ in p.coded_entries}

