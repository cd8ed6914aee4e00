"""Running the decode op (C++ twin, CUDA, or the NumPy reference behind the same interface) in each
of its modes, for the twin and GPU suites."""
from __future__ import annotations

import dataclasses

import torch

from cuda_ext import plans

MODES = (plans.MODE_BULK, plans.MODE_RECORD, plans.MODE_INDEXED)


def run_op(fn, data: torch.Tensor, p: plans.Plan, mode: int, entry_steps: int = 0, index=None):
    """Decode plan `p` with `fn` (ops.decode_pieces or ops.reference_decode_pieces) in `mode` into
    fresh outputs. Returns (status, outputs, index); INDEXED reads `index`, RECORD writes a new one."""
    outputs = plans.outputs(p, data.device)
    status, states, words = plans.buffers(p, data.device, mode, entry_steps)
    if index is not None:
        states, words = index
    fn(data, p.desc, plans.device_plan(p, outputs, mode, entry_steps), outputs, states, words, status, mode,
       entry_steps)
    return status, outputs, (states, words)


def every_mode(fn, data: torch.Tensor, p: plans.Plan, entry_steps: int) -> dict:
    """{mode: (status, outputs, index)}: BULK, RECORD, then INDEXED from the index RECORD wrote."""
    out = {plans.MODE_BULK: run_op(fn, data, p, plans.MODE_BULK)}
    out[plans.MODE_RECORD] = run_op(fn, data, p, plans.MODE_RECORD, entry_steps)
    out[plans.MODE_INDEXED] = run_op(fn, data, p, plans.MODE_INDEXED, entry_steps, out[plans.MODE_RECORD][2])
    return out


def shifted(data: torch.Tensor, p: plans.Plan, shift: int) -> tuple[torch.Tensor, plans.Plan]:
    """The same streams `shift` bytes further into the buffer: (data, plan) for a decode at
    addresses off the archive's alignment."""
    desc = p.desc.clone()
    for field in ("exp_off", "hi_off", "lo_off"):
        col = desc[:, plans.DESC_FIELDS.index(field)]
        col[col >= 0] += shift
    moved = torch.cat([torch.zeros(shift, dtype=torch.uint8), data.cpu()]).to(data.device)
    return moved, dataclasses.replace(p, desc=desc)


def decode_whole(path) -> dict[str, torch.Tensor]:
    """Every tensor of an archive in ONE decode_plan over its whole data region, on the CPU: the
    extension alone, without the loader's batches, ring or early reads (what the loader's tests
    compare the pipeline with)."""
    import cuda_ext
    from codec.decode import Archive
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
        return cuda_ext.decode_plan(p, data, archive.path)


def overlapping_segments(path) -> tuple[plans.Plan, torch.Tensor, tuple]:
    """An archive at `path` of one bf16 tensor whose two segments are the same symbols, then its
    data with the second segment's offset pointed at the first: (plan, bad data, the good data's
    index). Each segment would decode to the right bits; the directory breaks the format (segments
    never overlap), which every decoder must refuse."""
    from codec.constants import SEGMENT_SYMBOLS
    from codec.decode import Archive
    from codec.encode import compress_state_dict
    from cuda_ext import ops
    from tests.tensors import make_tensor
    half = make_tensor(torch.bfloat16, (SEGMENT_SYMBOLS,), 7, "normal")
    compress_state_dict({"w": torch.cat([half, half])}, path, workers=1)
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    index = run_op(ops.reference_decode_pieces, data, p, plans.MODE_RECORD, 256)[2]
    exp_off = int(p.desc[0, plans.DESC_FIELDS.index("exp_off")])
    assert not torch.equal(data[exp_off:exp_off + 8], data[exp_off + 8:exp_off + 16])
    data[exp_off + 8:exp_off + 16] = data[exp_off:exp_off + 8].clone()        # seg_off[1] = seg_off[0]
    return p, data, index
