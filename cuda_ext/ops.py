"""Typed wrappers of the `wcodec::` ops, their fake (meta) implementations, the pure-Python
reference with the same semantics, and sample inputs for torch.library.opcheck."""
from __future__ import annotations

import numpy as np
import torch

from codec import floatcodec, planes
from codec.constants import SEGMENT_SYMBOLS
from codec.floatcodec import FloatParams

from .plan import DESC_FIELDS, DTYPE_CODES

_LAYOUT_BY_CODE = {code: planes.FLOAT_LAYOUTS[name] for name, code in DTYPE_CODES.items()}
STATUS_DIRECTORY, STATUS_TABLE = 3, 4


def decode_float(data: torch.Tensor, desc: torch.Tensor, outputs: list[torch.Tensor],
                 n_segments: int) -> torch.Tensor:
    """Decode every float tensor described by `desc` (CPU int64 [n, 9], plan.DESC_FIELDS) from
    the uint8 `data` into `outputs` (preallocated, contiguous, on data's device), on the current
    stream. Returns an int32 status per segment (0 = ok); never raises on bad archive data."""
    return torch.ops.wcodec.decode_float.default(data, desc, outputs, n_segments)


def register_fakes() -> None:
    """Meta implementations for torch.compile / opcheck; called once the library is loaded."""
    if getattr(register_fakes, "done", False):
        return

    @torch.library.register_fake("wcodec::decode_float")
    def _(data, desc, outputs, n_segments):
        return data.new_empty((n_segments,), dtype=torch.int32)

    register_fakes.done = True


def reference_decode_float(data: torch.Tensor, desc: torch.Tensor, outputs: list[torch.Tensor],
                           n_segments: int) -> torch.Tensor:
    """The NumPy reference (codec/) behind the op's interface: CPU tensors only."""
    buf = data.numpy()
    status = np.zeros(n_segments, dtype=np.int32)
    items, targets = [], []
    for row, out in zip(desc.tolist(), outputs):
        d = dict(zip(DESC_FIELDS, row))
        layout = _LAYOUT_BY_CODE[d["dtype"]]
        params = FloatParams(d["numel"], d["ctx_bits"], d["table_group"], SEGMENT_SYMBOLS)
        segs = slice(d["first_segment"], d["first_segment"] + params.n_segments)
        try:
            parsed = floatcodec.parse_exp(buf[d["exp_off"]:d["exp_off"] + d["exp_len"]], params)
        except floatcodec.StreamFault as fault:
            status[segs] = STATUS_TABLE if fault.table else STATUS_DIRECTORY
            continue
        hi = buf[d["hi_off"]:d["hi_off"] + d["numel"]]
        lo = buf[d["lo_off"]:d["lo_off"] + 2 * d["numel"]].view("<u2") if d["lo_off"] >= 0 else None
        items.append((parsed, layout, hi))
        targets.append((segs, layout, hi, lo, out))
    for (sym, seg_status, _, _), (segs, layout, hi, lo, out) in zip(floatcodec.decode_batch(items) if items else [], targets):
        status[segs] = seg_status
        planes.join(layout, sym, hi, lo, out=out.view(-1).view(_word_dtype(layout)).numpy())
    return torch.from_numpy(status)


def _word_dtype(layout: planes.FloatLayout) -> torch.dtype:
    return torch.int32 if layout.itemsize == 4 else torch.int16


def sample_inputs(device: str | torch.device) -> list[tuple]:
    """Small archives' worth of op arguments (every dtype, multi-segment, a partial segment)."""
    from codec.encode import encode_tensors
    from .plan import build
    from codec.entries import TensorEntry
    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(SEGMENT_SYMBOLS + 999, generator=g).bfloat16(),
               "fp16": (torch.randn(5000, generator=g) * 3).half(),
               "fp32": torch.randn(70, 90, generator=g)}
    recs = encode_tensors([(n, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[n], tuple(t.shape),
                            t.reshape(-1).view(torch.uint8).numpy()) for n, t in tensors.items()])
    blob, entries = bytearray(), []
    for rec in recs:
        streams = {}
        for role, b in rec["streams"].items():
            streams[role] = {"offset": len(blob), "length": len(b), "crc32": 0}
            blob += b + b"\0" * (-len(b) % 64)
        entries.append(TensorEntry(rec["name"], rec["dtype"], tuple(rec["shape"]), rec["codec"], None,
                                   rec["nbytes"], rec["crc32"], streams,
                                   FloatParams(int(np.prod(rec["shape"])), **rec["params"])))
    p = build(entries, start=0, end=len(blob))
    data = torch.frombuffer(blob, dtype=torch.uint8).clone().to(device)
    outputs = [torch.empty(e.shape, dtype=e.torch_dtype, device=device) for e in p.float_entries]
    return [(data, p.desc, outputs, p.n_segments)], tensors
