"""Shared pieces of the bad-input tests: the small archive's tensor names, the flip helper and
`expect`, which asserts the exact CodecError subclass and that its message names the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from codec import errors
from codec.decode import load

BF16 = "model.embed_tokens.weight"          # float-coded: exp, hi
FP32 = "model.layers.0.mlp.weight"          # float-coded: exp, hi, lo
INTS = "model.layers.0.ids"                 # raw
SCALAR = "model.norm.scale"                 # raw, 0-d


def expect(cls: type[errors.CodecError], path: Path, *, verify: bool = True,
           workers: int = 1) -> errors.CodecError:
    """load() must raise exactly `cls`, its message starting with the path."""
    with pytest.raises(errors.CodecError) as info:
        load(path, verify=verify, workers=workers)
    err = info.value
    assert type(err) is cls, f"{type(err).__name__}: {err}"
    assert str(err).startswith(str(path)) and err.path == str(path)
    return err


def flip_in_stream(archive, name: str, role: str, at: float = 0.5, mask: int = 0x10) -> bytes:
    rec = archive.tensor(name)["streams"][role]
    data = bytearray(archive.data)
    data[rec["offset"] + int(at * (rec["length"] - 1))] ^= mask
    return bytes(data)


