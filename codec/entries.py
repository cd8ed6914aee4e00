"""Tensor entries of the header: dtypes, validation, and the per-tensor record."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import errors
from .codecs import CODECS, GGUFParams
from .constants import STREAM_ALIGN
from .floatcodec import FloatParams, min_stream_bytes

# Every dtype an archive may hold; which codecs apply to which is the codec table's (codecs.py).
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_DIM = (1 << 63) - 1             # a dimension is an int64 for torch (a zero elsewhere hides any product)


def dtype_name(path, name: str, dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise errors.UnsupportedTensor(path, f"tensor {name!r}: dtype {dtype} cannot be stored")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    layer: int | None
    nbytes: int
    crc32: int
    streams: dict
    params: FloatParams | GGUFParams | None     # the codec's (codecs.py)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_json(self) -> dict:
        out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "codec": self.codec,
               "layer": self.layer, "nbytes": self.nbytes, "crc32": self.crc32, "streams": self.streams}
        if self.params is not None:
            out["params"] = self.params.to_json()
        return out

    @classmethod
    def from_json(cls, path, rec) -> "TensorEntry":
        """Validate one header record; any lie about sizes or types is a HeaderError."""
        def bad(what):
            name = rec.get("name") if isinstance(rec, dict) else None
            return errors.HeaderError(path, f"tensor {name!r}: {what}")
        if not isinstance(rec, dict) or not isinstance(rec.get("name"), str):
            raise bad("record is not an object with a name")
        dtype, shape, codec = rec.get("dtype"), rec.get("shape"), rec.get("codec")
        if dtype not in DTYPES:
            raise bad(f"unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_uint(d) and d <= MAX_DIM for d in shape):
            raise bad(f"shape is not a list of integers in [0, {MAX_DIM}]")
        row = CODECS.get(codec)
        if row is None or not row.applies(dtype):
            raise bad(f"codec {codec!r} does not apply to {dtype}")
        itemsize = DTYPES[dtype].itemsize
        if rec.get("nbytes") != math.prod(shape) * itemsize or not _is_crc(rec.get("crc32")):
            raise bad("nbytes or crc32 disagree with the shape")
        n = math.prod(shape)
        if n * itemsize > MAX_DIM:
            raise bad("shape holds more bytes than an int64 counts")
        params = row.parse(rec.get("params"), tuple(shape), dtype, bad)
        streams = rec.get("streams")
        needed = row.roles(dtype, params)
        if not isinstance(streams, dict) or set(streams) != set(needed) \
                or not all(isinstance(s, dict) for s in streams.values()):
            raise bad(f"streams must be exactly {list(needed)}")
        if not all(_is_uint(s.get("offset")) and s["offset"] % STREAM_ALIGN == 0 and _is_uint(s.get("length"))
                   and _is_crc(s.get("crc32")) for s in streams.values()):
            raise bad(f"a stream offset or length is not a non-negative integer (offsets: multiples of {STREAM_ALIGN}) "
                      "or its crc32 is not a u32")
        planes = row.raw_lengths(n, itemsize, params)
        if any(streams[role]["length"] != size for role, size in planes.items() if role in streams):
            raise bad("a plane's length disagrees with the shape")
        if any(streams[role]["length"] < min_stream_bytes(p) for role, p in row.coded(dtype, params).items()):
            raise bad("a coded stream is shorter than the segments its shape needs")
        layer = rec.get("layer")
        if layer is not None and not _is_uint(layer):
            raise bad("layer is not a non-negative integer")
        return cls(rec["name"], dtype, tuple(shape), codec, layer, rec["nbytes"], rec["crc32"],
                   streams, params)

    @property
    def codec_row(self):
        """This entry's row of the codec table (codecs.py)."""
        return CODECS[self.codec]


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_crc(v) -> bool:
    return _is_uint(v) and v <= 0xFFFFFFFF
