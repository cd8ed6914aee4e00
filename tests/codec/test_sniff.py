"""Format detection (codec.sources._sniff) never takes a valid safetensors file for anything else.

A safetensors file starts with its JSON header's length as a u64: its first byte is that length's
low byte, any value, 0x80 (the pickle protocol byte) included, and a header of 0x04034B50 bytes
starts with the zip magic. Every file here is valid by safetensors' own reader (`safe_open`), and
each must be detected as safetensors, opened, and read back bit for bit.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save

from codec.sources import PICKLE_PROTO, ZIP_MAGIC, SourceError, _sniff, open_source
from tests.tensors import assert_bit_exact
from wcodec import cli

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.int64, torch.bool,
          torch.float8_e4m3fn, torch.float8_e5m2]


def with_header_length(blob: bytes, length: int) -> bytes:
    """A safetensors file re-written with its JSON header padded by spaces to `length` bytes (the
    writer's own padding is spaces too); tensor data and offsets are unchanged."""
    (n,) = struct.unpack("<Q", blob[:8])
    body = json.dumps(json.loads(blob[8:8 + n]), separators=(",", ":")).encode()
    assert len(body) <= length, (len(body), length)
    return struct.pack("<Q", length) + body + b" " * (length - len(body)) + blob[8 + n:]


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"e4m3.all": torch.randn(64, generator=gen).to(torch.float8_e4m3fn),
            "e4m3.scale": torch.rand(1, generator=gen), "e4m3.w": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
            "e5m2.all": torch.randn(64, generator=gen).to(torch.float8_e5m2),
            "e5m2.w": torch.randint(-9, 9, (5, 3), generator=gen, dtype=torch.int32)}


def _check_read_back(path: Path, state: dict[str, torch.Tensor]) -> None:
    with safe_open(str(path), framework="pt") as f:           # safetensors itself accepts the file
        assert set(f.keys()) == set(state)
    assert _sniff(path) == "safetensors"
    with open_source(path) as src:
        assert_bit_exact(state, {i.name: src.load(i.name) for i in src.tensors()})


@pytest.fixture(scope="module")
def base_blob() -> tuple[dict[str, torch.Tensor], bytes]:
    state = _state(0)
    return state, save(state)


@pytest.mark.parametrize("low", range(256), ids=lambda b: f"{b:#04x}")
def test_every_low_byte_of_the_header_length(tmp_path: Path, base_blob, low: int) -> None:
    """Every value of the file's first byte: 0x80 was taken for a pickle (issue 12)."""
    state, blob = base_blob
    length = 0x400 + low                                      # longer than the header, low byte = `low`
    path = tmp_path / "m.safetensors"
    path.write_bytes(with_header_length(blob, length))
    assert path.read_bytes()[0] == low
    _check_read_back(path, state)


def test_first_byte_0x80_compresses_through_the_cli(tmp_path: Path, base_blob, capsys) -> None:
    state, blob = base_blob
    src = tmp_path / "fp8.safetensors"
    src.write_bytes(with_header_length(blob, 0x380))
    assert src.read_bytes()[0] == PICKLE_PROTO
    assert cli.main(["compress", str(src), str(tmp_path / "fp8.wcodec"), "--workers", "1"]) == 0, \
        capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "fp8.wcodec"), "--against", str(src)]) == 0


def test_header_length_that_spells_the_zip_magic(tmp_path: Path, base_blob) -> None:
    """A 67 MB header (0x04034B50 bytes, a multiple of 8 as the writer pads) starts with b'PK\\x03\\x04'."""
    state, blob = base_blob
    path = tmp_path / "big-header.safetensors"
    path.write_bytes(with_header_length(blob, int.from_bytes(ZIP_MAGIC, "little")))
    assert path.read_bytes()[:4] == ZIP_MAGIC
    _check_read_back(path, state)


def test_safetensors_content_wins_over_a_pickle_suffix(tmp_path: Path, base_blob) -> None:
    state, blob = base_blob
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(with_header_length(blob, 0x280))
    _check_read_back(path, state)


@pytest.mark.parametrize("head", [bytes([PICKLE_PROTO, 4]) + b"\x95" + bytes(6) + b"{", ZIP_MAGIC + bytes(5)],
                         ids=["pickle-proto-4", "zip"])
def test_a_pickle_is_still_refused(tmp_path: Path, head: bytes) -> None:
    """A header length beyond the file is no safetensors layout: the pickle/zip bytes decide."""
    path = tmp_path / "weights.data"
    path.write_bytes(head + b"\0" * 64)
    assert _sniff(path) == "pickle"
    with pytest.raises(SourceError, match="pickle"):
        open_source(path)


def test_unknown_content_with_a_pickle_suffix_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(SourceError, match="pickle"):
        open_source(path)


@st.composite
def state_dicts(draw) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789._"), min_size=1,
                                  max_size=40).filter(lambda n: n != "__metadata__"),   # safetensors' reserved key
                          min_size=1, max_size=6, unique=True))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        out[name] = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8) \
            .view(dtype).reshape(shape)
    return out


@settings(max_examples=300)
@given(state=state_dicts(), extra=st.integers(0, 4096), metadata=st.booleans())
def test_any_valid_safetensors_file_is_detected(tmp_path_factory, state, extra: int, metadata: bool) -> None:
    """Real writer output (any names, dtypes, shapes), its header re-padded by `extra` bytes: the
    header length takes every low byte and many high ones."""
    blob = save(state, metadata={"format": "pt"} if metadata else None)
    (n,) = struct.unpack("<Q", blob[:8])
    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    path.write_bytes(with_header_length(blob, n + extra))
    _check_read_back(path, state)
