"""Bad archives and bad inputs: every failure is one exact CodecError subclass whose message
starts with the file's path; never an IndexError, ValueError, struct.error, OSError or a hang.

Forged archives keep every CRC valid except where a test says otherwise (see conftest.ArchiveBytes),
so each test reaches the check it names.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from bad_input_helpers import BF16, FP32, INTS, SCALAR, expect, flip_in_stream

from codec import container, errors
from codec.constants import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAGIC,
    MAX_HEADER_BYTES,
    PREAMBLE_SIZE,
    STREAM_ALIGN,
)
from codec.decode import Archive, load


def test_small_archive_is_what_the_forgeries_assume(small_archive, small_state_dict, write_archive,
                                                    bit_exact) -> None:
    path = write_archive(small_archive.data)
    bit_exact(small_state_dict, load(path, workers=1).state_dict)
    codecs = {t["name"]: (t["codec"], sorted(t["streams"])) for t in small_archive.header["tensors"]}
    assert codecs == {BF16: ("float", ["exp", "hi"]), FP32: ("float", ["exp", "hi", "lo"]),
                      INTS: ("raw", ["raw"]), SCALAR: ("raw", ["raw"])}


# --- not an archive ----------------------------------------------------------------------------


def test_nonexistent_file(tmp_path: Path) -> None:
    expect(errors.CodecError, tmp_path / "missing.wcodec")
    with pytest.raises(errors.CodecError) as info:
        Archive.open(tmp_path / "missing.wcodec")
    assert type(info.value) is errors.CodecError


def test_directory(tmp_path: Path) -> None:
    (tmp_path / "dir.wcodec").mkdir()
    expect(errors.CodecError, tmp_path / "dir.wcodec")


@pytest.mark.parametrize("data", [b"", b"\x89", b"x", MAGIC[:7]], ids=["empty", "magic-byte", "one-byte", "7-bytes"])
def test_too_short_for_the_magic(write_archive, data: bytes) -> None:
    expect(errors.NotAWcodecFile, write_archive(data))


def test_wrong_magic(small_archive, write_archive) -> None:
    for i in (0, 1, 7):
        data = bytearray(small_archive.data)
        data[i] ^= 0x20
        expect(errors.NotAWcodecFile, write_archive(bytes(data)))
    expect(errors.NotAWcodecFile, write_archive(b'{"format": "wcodec"}' + b"\0" * 100))


# --- truncated / extended ----------------------------------------------------------------------


def _cuts(archive) -> dict[str, int]:
    pre = archive.preamble
    return {"preamble-8": 8, "preamble-32": 32, "preamble-63": PREAMBLE_SIZE - 1, "no-data": PREAMBLE_SIZE,
            "data-start": pre.data_offset + 1, "data-middle": (pre.data_offset + pre.header_offset) // 2,
            "header-start": pre.header_offset, "header-middle": pre.header_offset + pre.header_length // 2,
            "last-byte": pre.file_length - 1}


@pytest.mark.parametrize("where", ["preamble-8", "preamble-32", "preamble-63", "no-data", "data-start",
                                   "data-middle", "header-start", "header-middle", "last-byte"])
def test_truncated(small_archive, write_archive, where: str) -> None:
    cut = _cuts(small_archive)[where]
    expect(errors.TruncatedFile, write_archive(small_archive.data[:cut]))


def test_truncated_inside_the_magic(small_archive, write_archive) -> None:
    expect(errors.NotAWcodecFile, write_archive(small_archive.data[:4]))


def test_longer_than_the_preamble_says(small_archive, write_archive) -> None:
    expect(errors.HeaderError, write_archive(small_archive.data + b"\0" * 17))


# --- flipped bytes -----------------------------------------------------------------------------

STREAMS = [(BF16, "exp"), (BF16, "hi"), (FP32, "exp"), (FP32, "hi"), (FP32, "lo"), (INTS, "raw"),
           (SCALAR, "raw")]


@pytest.mark.parametrize("name,role", STREAMS)
def test_flipped_stream_byte_fails_its_crc(small_archive, write_archive, name: str, role: str) -> None:
    expect(errors.ChecksumError, write_archive(flip_in_stream(small_archive, name, role)))


def test_flipped_raw_byte_without_verify_is_served_as_stored(small_archive, small_state_dict,
                                                             write_archive) -> None:
    """verify=False trusts raw streams: the flipped byte comes back, and nothing else changes."""
    path = write_archive(flip_in_stream(small_archive, INTS, "raw", at=0.0, mask=0x01))
    got = load(path, verify=False, workers=1).state_dict
    expected = small_state_dict[INTS].clone()
    expected.view(torch.uint8)[0] ^= 1
    assert torch.equal(got[INTS].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(got[BF16].view(torch.uint8), small_state_dict[BF16].view(torch.uint8))


@pytest.mark.parametrize("name,role", [(BF16, "hi"), (FP32, "hi"), (FP32, "lo")])
def test_flipped_raw_plane_without_verify_does_not_crash(small_archive, write_archive, name: str,
                                                         role: str) -> None:
    """A raw plane bit may change an element's context, hence its table: either the rANS check
    fires or the element comes back with the flipped bit; nothing else may happen."""
    path = write_archive(flip_in_stream(small_archive, name, role, mask=0x40))
    try:
        model = load(path, verify=False, workers=1)
    except errors.CorruptStreamError as err:
        assert str(err).startswith(str(path))
    else:
        assert list(model.state_dict[name].shape) == small_archive.tensor(name)["shape"]


def test_flipped_header_byte_fails_the_header_crc(small_archive, write_archive) -> None:
    data = bytearray(small_archive.data)
    data[small_archive.preamble.header_offset + 20] ^= 0x01
    expect(errors.ChecksumError, write_archive(bytes(data)))


def test_wrong_header_crc(small_archive, write_archive) -> None:
    bad = small_archive.with_preamble(header_crc32=small_archive.preamble.header_crc32 ^ 1)
    expect(errors.ChecksumError, write_archive(bad))


# --- preamble ----------------------------------------------------------------------------------


@pytest.mark.parametrize("major", [0, FORMAT_MAJOR + 1, 0xFFFF])
def test_unknown_major_version(small_archive, write_archive, major: int) -> None:
    data = bytearray(small_archive.data)
    data[8:10] = major.to_bytes(2, "little")
    err = expect(errors.UnsupportedVersion, write_archive(bytes(data)))
    assert f"{major}." in str(err)


def test_newer_minor_version_is_read(small_archive, small_state_dict, write_archive, bit_exact) -> None:
    path = write_archive(small_archive.with_preamble(minor=FORMAT_MINOR + 7))
    bit_exact(small_state_dict, load(path, workers=1).state_dict)


@pytest.mark.parametrize("at,kind", [(12, errors.UnsupportedVersion), (15, errors.UnsupportedVersion),
                                     (36, errors.HeaderError), (63, errors.HeaderError)])
def test_preamble_flags_and_reserved_fields_must_be_zero(small_archive, write_archive, at: int, kind) -> None:
    """flags (12..15) name features this reader does not know; reserved (36..39, 56..63) are 0."""
    data = bytearray(small_archive.data)
    data[at] ^= 0x01
    expect(kind, write_archive(bytes(data)))


@pytest.mark.parametrize("field,value", [("data_offset", 0), ("data_offset", PREAMBLE_SIZE - 1),
                                         ("data_offset", 1 << 40), ("header_offset", 0),
                                         ("header_offset", 1 << 62), ("header_length", 0),
                                         ("header_length", 3)])
def test_inconsistent_preamble_offsets(small_archive, write_archive, field: str, value: int) -> None:
    expect(errors.HeaderError, write_archive(small_archive.with_preamble(**{field: value})))


@pytest.mark.parametrize("length", [MAX_HEADER_BYTES + 1, 1 << 63])
def test_oversized_header_is_refused_unread(small_archive, write_archive, monkeypatch, length: int) -> None:
    path = write_archive(small_archive.with_preamble(header_length=length))

    def read_header(*args):
        raise AssertionError("the oversized header was read")

    monkeypatch.setattr(container, "_read_header", read_header)
    expect(errors.HeaderError, path)


# --- header: not a header ----------------------------------------------------------------------

NOT_A_HEADER = {
    "not-json": b"this is not json {",
    "bad-utf8": b'{"format": "wcodec\xff\xfe"}',
    "list": b"[]",
    "string": b'"wcodec"',
    "no-tensors": b'{"format": "wcodec", "files": {}}',
    "tensors-not-list": b'{"format": "wcodec", "files": {}, "tensors": {}}',
    "files-not-dict": b'{"format": "wcodec", "files": [], "tensors": []}',
    "wrong-format": b'{"format": "zip", "files": {}, "tensors": []}',
    "huge-int": b'{"format": "wcodec", "files": {}, "tensors": [], "x": ' + b"9" * 5000 + b"}",
    "deeply-nested": b'{"format": "wcodec", "files": {}, "tensors": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("body", list(NOT_A_HEADER.values()), ids=list(NOT_A_HEADER))
def test_header_is_not_a_header(small_archive, write_archive, body: bytes) -> None:
    expect(errors.HeaderError, write_archive(small_archive.with_header(body)))


# --- header: valid JSON and CRC, but it lies ---------------------------------------------------


def _tensor(h: dict, name: str) -> dict:
    return next(t for t in h["tensors"] if t["name"] == name)


def _lie_huge_shape(h, name, per):
    t = _tensor(h, name)
    t["shape"] = [1 << 40, 1 << 40]
    t["nbytes"] = (1 << 80) * per


def _lie_big_shape(h, name, per):
    t = _tensor(h, name)                  # 64 GiB: consistent with nbytes, impossible for the file
    t["shape"] = [1 << 34]
    t["nbytes"] = (1 << 34) * per


LIES: dict[str, Callable[[dict], None]] = {
    "offset-past-end": lambda h: _tensor(h, INTS)["streams"]["raw"].update(offset=1 << 40),
    "offset-in-header": lambda h: _tensor(h, INTS)["streams"]["raw"].update(
        offset=_tensor(h, INTS)["streams"]["raw"]["offset"] + 10**6),
    "offset-in-preamble": lambda h: _tensor(h, BF16)["streams"]["hi"].update(offset=0),
    "offset-not-int": lambda h: _tensor(h, BF16)["streams"]["exp"].update(offset="4096"),
    "offset-float": lambda h: _tensor(h, BF16)["streams"]["exp"].update(offset=4096.0),
    "offset-unaligned": lambda h: _tensor(h, FP32)["streams"]["lo"].update(
        offset=_tensor(h, FP32)["streams"]["lo"]["offset"] + 2),
    "negative-length": lambda h: _tensor(h, FP32)["streams"]["lo"].update(length=-1),
    "length-into-header": lambda h: _tensor(h, FP32)["streams"]["lo"].update(length=1 << 30),
    "length-missing": lambda h: _tensor(h, INTS)["streams"]["raw"].pop("length"),
    "huge-shape-raw": lambda h: _lie_huge_shape(h, INTS, 4),
    "huge-shape-float": lambda h: _lie_huge_shape(h, BF16, 2),
    "big-shape-raw": lambda h: _lie_big_shape(h, INTS, 4),
    "big-shape-float": lambda h: _lie_big_shape(h, FP32, 4),
    "negative-dim": lambda h: _tensor(h, INTS).update(shape=[-37]),
    "dim-not-int": lambda h: _tensor(h, INTS).update(shape=[37.0]),
    "shape-not-list": lambda h: _tensor(h, INTS).update(shape=37),
    "unknown-dtype": lambda h: _tensor(h, INTS).update(dtype="int4"),
    "unknown-codec": lambda h: _tensor(h, INTS).update(codec="zstd"),
    "float-codec-on-ints": lambda h: _tensor(h, INTS).update(codec="float"),
    "wrong-nbytes": lambda h: _tensor(h, BF16).update(nbytes=_tensor(h, BF16)["nbytes"] + 2),
    "nbytes-missing": lambda h: _tensor(h, SCALAR).pop("nbytes"),
    "crc-not-int": lambda h: _tensor(h, SCALAR).update(crc32="0"),
    "missing-stream": lambda h: _tensor(h, FP32)["streams"].pop("lo"),
    "missing-streams": lambda h: _tensor(h, BF16).pop("streams"),
    "extra-stream": lambda h: _tensor(h, BF16)["streams"].update(lo=_tensor(h, BF16)["streams"]["hi"]),
    "stream-not-object": lambda h: _tensor(h, INTS)["streams"].update(raw=[4096, 10]),
    "ctx-bits-7": lambda h: _tensor(h, BF16)["params"].update(ctx_bits=7),
    "ctx-bits-negative": lambda h: _tensor(h, BF16)["params"].update(ctx_bits=-1),
    "segment-symbols-5": lambda h: _tensor(h, BF16)["params"].update(segment_symbols=5),
    "table-group-0": lambda h: _tensor(h, FP32)["params"].update(table_group=0),
    "params-missing": lambda h: _tensor(h, FP32).pop("params"),
    "float-codec-on-empty": lambda h: _tensor(h, BF16).update(shape=[0, 6000], nbytes=0),
    "negative-layer": lambda h: _tensor(h, INTS).update(layer=-1),
    "record-not-object": lambda h: h["tensors"].append(["x"]),
    "record-without-name": lambda h: _tensor(h, INTS).pop("name"),
    "duplicate-names": lambda h: _tensor(h, INTS).update(name=BF16),
    "file-record-not-object": lambda h: h["files"].update({"config.json": [4096, 3]}),
    "file-record-past-end": lambda h: h["files"].update({"config.json": {"offset": 1 << 40, "length": 3,
                                                                          "crc32": 0}}),
}


@pytest.mark.parametrize("lie", list(LIES.values()), ids=list(LIES))
def test_header_lies(small_archive, write_archive, lie: Callable[[dict], None]) -> None:
    header = copy.deepcopy(small_archive.header)
    lie(header)
    expect(errors.HeaderError, write_archive(small_archive.with_header(header)))


def test_table_group_larger_than_needed_is_clamped(small_archive, small_state_dict, write_archive,
                                                   bit_exact) -> None:
    header = small_archive.header
    _tensor(header, BF16)["params"]["table_group"] = 10**30
    bit_exact(small_state_dict, load(write_archive(small_archive.with_header(header)), workers=1).state_dict)


def test_relocated_streams_still_decode(small_archive, small_state_dict, write_archive, bit_exact) -> None:
    """The reader takes every stream from its record: move the whole data region 64 bytes on
    (offsets, header_offset and file_length follow) and the tensors come back bit for bit."""
    header, pre = small_archive.header, small_archive.preamble
    for rec in [r for t in header["tensors"] for r in t["streams"].values()] + list(header["files"].values()):
        rec["offset"] += STREAM_ALIGN
    body = json.dumps(header).encode()
    region = small_archive.region
    lead = pre.data_offset - PREAMBLE_SIZE
    region = region[:lead] + bytes(STREAM_ALIGN) + region[lead:]
    moved = dataclasses.replace(pre, header_offset=pre.header_offset + STREAM_ALIGN, header_length=len(body),
                                header_crc32=container.crc32(body),
                                file_length=pre.header_offset + STREAM_ALIGN + len(body))
    path = write_archive(moved.pack() + region + body)
    bit_exact(small_state_dict, load(path, workers=1).state_dict)


