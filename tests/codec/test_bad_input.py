"""Bad archives and bad inputs: every failure is one exact CodecError subclass whose message
starts with the file's path; never an IndexError, ValueError, struct.error, OSError or a hang.

Forged archives keep every CRC valid except where a test says otherwise (see conftest.ArchiveBytes),
so each test reaches the check it names.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import container, errors
from codec.constants import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAGIC,
    MAX_HEADER_BYTES,
    PREAMBLE_SIZE,
    SEGMENT_ALIGN,
    SEGMENT_SYMBOLS,
    STATE_BYTES,
    STREAM_ALIGN,
)
from codec.decode import Archive, load
from codec.encode import compress, compress_state_dict
from codec.floatcodec import FloatParams

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


def _flip_in_stream(archive, name: str, role: str, at: float = 0.5, mask: int = 0x10) -> bytes:
    rec = archive.tensor(name)["streams"][role]
    data = bytearray(archive.data)
    data[rec["offset"] + int(at * (rec["length"] - 1))] ^= mask
    return bytes(data)


@pytest.mark.parametrize("name,role", STREAMS)
def test_flipped_stream_byte_fails_its_crc(small_archive, write_archive, name: str, role: str) -> None:
    expect(errors.ChecksumError, write_archive(_flip_in_stream(small_archive, name, role)))


@pytest.mark.parametrize("name", [BF16, FP32])
@pytest.mark.parametrize("word", ["first", "middle", "last"])
def test_flipped_exp_word_without_verify(small_archive, write_archive, name: str, word: str) -> None:
    """verify=False skips the CRCs, so the rANS final-state check is what must catch it."""
    exp = Exp(small_archive, name)
    i = {"first": 0, "middle": int(exp.seg_words[0]) // 2, "last": int(exp.seg_words[0]) - 1}[word]
    at = small_archive.tensor(name)["streams"]["exp"]["offset"] + int(exp.seg_off[0]) + STATE_BYTES + 2 * i
    data = bytearray(small_archive.data)
    data[at + 1] ^= 0x10
    expect(errors.CorruptStreamError, write_archive(bytes(data)), verify=False)


def test_flipped_raw_byte_without_verify_is_served_as_stored(small_archive, small_state_dict,
                                                             write_archive) -> None:
    """verify=False trusts raw streams: the flipped byte comes back, and nothing else changes."""
    path = write_archive(_flip_in_stream(small_archive, INTS, "raw", at=0.0, mask=0x01))
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
    path = write_archive(_flip_in_stream(small_archive, name, role, mask=0x40))
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


# --- streams whose CRC is valid but whose contents lie ------------------------------------------


# A stream record whose length disagrees with the tensor's shape is the header lying about sizes
# (errors.HeaderError's definition), found without decoding anything; CorruptStreamError is for a
# stream that is inconsistent inside itself.


def test_raw_stream_shorter_than_nbytes(small_archive, write_archive) -> None:
    bad = small_archive.with_stream(INTS, "raw", small_archive.stream(INTS, "raw")[:-4])
    expect(errors.HeaderError, write_archive(bad))


@pytest.mark.parametrize("name,role", [(BF16, "hi"), (FP32, "lo")])
def test_raw_plane_with_wrong_length(small_archive, write_archive, name: str, role: str) -> None:
    bad = small_archive.with_stream(name, role, small_archive.stream(name, role)[:-2])
    expect(errors.HeaderError, write_archive(bad))


class Exp:
    """An exp stream split by its directory (floatcodec's docstring), editable in place."""

    def __init__(self, archive, name: str):
        t = archive.tensor(name)
        p = t["params"]
        n = int(np.prod(t["shape"]))
        self.params = FloatParams(n, p["ctx_bits"], min(p["table_group"], -(-n // SEGMENT_SYMBOLS)))
        self.buf = np.frombuffer(archive.stream(name, "exp"), np.uint8).copy()
        n_seg, n_tab = self.params.n_segments, self.params.n_tables
        self.seg_off = self.buf[:8 * n_seg].view("<u8")
        self.seg_words = self.buf[8 * n_seg:12 * n_seg].view("<u4")
        self.tab_off = self.buf[12 * n_seg:12 * n_seg + 4 * (n_tab + 1)].view("<u4")

    def table_freqs(self, j: int) -> np.ndarray:
        start = int(self.tab_off[j]) + 32
        return self.buf[start:int(self.tab_off[j + 1])].view("<u2")

    def words(self, seg: int) -> np.ndarray:
        start = int(self.seg_off[seg]) + STATE_BYTES
        return self.buf[start:start + 2 * int(self.seg_words[seg])].view("<u2")

    def states(self, seg: int) -> np.ndarray:
        return self.buf[int(self.seg_off[seg]):int(self.seg_off[seg]) + STATE_BYTES].view("<u4")


def _first_used_table(exp: Exp) -> int:
    return next(j for j in range(exp.params.n_tables) if len(exp.table_freqs(j)) >= 2)


def _table_sum(exp: Exp) -> None:
    exp.table_freqs(_first_used_table(exp))[0] += 1


def _table_zero(exp: Exp) -> None:
    f = exp.table_freqs(_first_used_table(exp))
    f[1] += f[0]
    f[0] = 0


def _swap_words(exp: Exp) -> None:
    w = exp.words(0)
    i = int(np.flatnonzero(w != w[len(w) // 2])[0])
    w[[i, len(w) // 2]] = w[[len(w) // 2, i]]


EXP_LIES: dict[str, Callable[[Exp], None]] = {
    "table-sum-wrong": _table_sum,
    "table-present-symbol-zero": _table_zero,
    "table-offsets-out-of-order": lambda e: e.tab_off.__setitem__(1, e.tab_off[0] - 4),
    "first-table-offset-wrong": lambda e: e.tab_off.__setitem__(0, e.tab_off[0] + 4),
    "tables-end-past-stream": lambda e: e.tab_off.__setitem__(-1, len(e.buf) + 4),
    "segment-offset-past-stream": lambda e: e.seg_off.__setitem__(0, len(e.buf) + SEGMENT_ALIGN),
    "segment-offset-huge": lambda e: e.seg_off.__setitem__(0, (1 << 64) - SEGMENT_ALIGN),
    "segment-offset-unaligned": lambda e: e.seg_off.__setitem__(0, e.seg_off[0] + 2),
    "segment-overlaps-tables": lambda e: e.seg_off.__setitem__(0, e.seg_off[0] - SEGMENT_ALIGN),
    "segment-words-past-stream": lambda e: e.seg_words.__setitem__(0, e.seg_words[0] + 64),
    "segment-words-huge": lambda e: e.seg_words.__setitem__(0, 0xFFFFFFFF),
    "segment-one-word-short": lambda e: e.seg_words.__setitem__(0, e.seg_words[0] - 1),
    "segment-no-words": lambda e: e.seg_words.__setitem__(0, 0),
    "state-changed": lambda e: e.states(0).__setitem__(5, e.states(0)[5] ^ 0x100),
    "states-zero": lambda e: e.states(0).__setitem__(slice(None), 0),
    "words-swapped": _swap_words,
    "word-flipped": lambda e: e.words(0).__setitem__(3, e.words(0)[3] ^ 0x8000),
}


@pytest.mark.parametrize("name", [BF16, FP32])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("lie", list(EXP_LIES.values()), ids=list(EXP_LIES))
def test_exp_stream_lies_with_valid_crc(small_archive, write_archive, lie, name: str, verify: bool) -> None:
    exp = Exp(small_archive, name)
    lie(exp)
    expect(errors.CorruptStreamError, write_archive(small_archive.with_stream(name, "exp", exp.buf.tobytes())),
           verify=verify)


@pytest.mark.parametrize("size", [0, 1, 11, 24, 40, 100])
def test_exp_stream_truncated_with_valid_crc(small_archive, write_archive, size: int) -> None:
    bad = small_archive.with_stream(BF16, "exp", small_archive.stream(BF16, "exp")[:size])
    expect(errors.CorruptStreamError, write_archive(bad))


def test_exp_stream_all_zero_with_valid_crc(small_archive, write_archive) -> None:
    zeros = bytes(len(small_archive.stream(FP32, "exp")))
    expect(errors.CorruptStreamError, write_archive(small_archive.with_stream(FP32, "exp", zeros)))


# --- several segments --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_segment_archive(archive_of):
    gen = torch.Generator().manual_seed(99)
    archive = archive_of({"w": (torch.randn(2 * SEGMENT_SYMBOLS + 100, generator=gen) * 0.02).to(torch.bfloat16)})
    assert Exp(archive, "w").params.n_segments == 3
    return archive


MULTI_LIES: dict[str, Callable[[Exp], None]] = {
    "segments-overlap": lambda e: e.seg_off.__setitem__(1, e.seg_off[0]),
    "segments-swapped": lambda e: e.seg_off.__setitem__(slice(0, 2), e.seg_off[1::-1].copy()),
    "last-segment-past-stream": lambda e: e.seg_off.__setitem__(2, len(e.buf)),
    "word-counts-swapped": lambda e: e.seg_words.__setitem__(slice(0, 2), e.seg_words[1::-1].copy()),
    "middle-state-changed": lambda e: e.states(1).__setitem__(31, e.states(1)[31] + 1),
}


@pytest.mark.parametrize("lie", list(MULTI_LIES.values()), ids=list(MULTI_LIES))
def test_multi_segment_lies(multi_segment_archive, write_archive, lie) -> None:
    exp = Exp(multi_segment_archive, "w")
    lie(exp)
    bad = multi_segment_archive.with_stream("w", "exp", exp.buf.tobytes())
    expect(errors.CorruptStreamError, write_archive(bad), verify=False)


# --- random corruption -------------------------------------------------------------------------


def _regions(archive) -> dict[str, tuple[int, int]]:
    """[start, end) byte ranges of an archive worth aiming at."""
    pre = archive.preamble
    recs = [r for t in archive.header["tensors"] for r in t["streams"].values()]
    return {"anywhere": (0, pre.file_length), "preamble": (0, PREAMBLE_SIZE),
            "streams": (min(r["offset"] for r in recs), max(r["offset"] + r["length"] for r in recs)),
            "header": (pre.header_offset, pre.file_length)}


@pytest.mark.timeout(180)
@settings(max_examples=400)
@given(st.data())
def test_random_byte_flips_anywhere(small_archive, small_state_dict, write_archive, bit_exact, data) -> None:
    """Any flipped bytes: load() returns the exact tensors (the flip hit padding or an ignored
    field) or raises a CodecError naming the file; nothing else, and it returns promptly."""
    regions = _regions(small_archive)
    buf = bytearray(small_archive.data)
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        start, end = regions[data.draw(st.sampled_from(sorted(regions)), label="region")]
        buf[data.draw(st.integers(start, end - 1), label="at")] ^= data.draw(st.integers(1, 255), label="mask")
    path = write_archive(bytes(buf), "flipped.wcodec")
    try:
        model = load(path, workers=1)
    except errors.CodecError as err:
        assert str(err).startswith(str(path))
    else:
        bit_exact(small_state_dict, model.state_dict)


def _exp_regions(exp: Exp) -> dict[str, tuple[int, int]]:
    tables_end, first = int(exp.tab_off[-1]), int(exp.seg_off[0])
    return {"anywhere": (0, len(exp.buf)), "directory": (0, int(exp.tab_off[0])),
            "tables": (int(exp.tab_off[0]), tables_end), "states": (first, first + STATE_BYTES),
            "words": (first + STATE_BYTES, first + STATE_BYTES + 2 * int(exp.seg_words[0]))}


@pytest.mark.timeout(180)
@settings(max_examples=300)
@given(st.sampled_from([BF16, FP32]), st.booleans(), st.data())
def test_random_exp_corruption_with_valid_crc(small_archive, small_state_dict, write_archive, bit_exact,
                                              name: str, verify: bool, data) -> None:
    """Bytes of an exp stream rewritten and its CRC recomputed: only the decoder's own checks (and
    the decoded-bytes CRC when verifying) stand between the damage and the caller."""
    exp = Exp(small_archive, name)
    regions = _exp_regions(exp)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        start, end = regions[data.draw(st.sampled_from(sorted(regions)), label="region")]
        exp.buf[data.draw(st.integers(start, end - 1), label="at")] = data.draw(st.integers(0, 255), label="value")
    path = write_archive(small_archive.with_stream(name, "exp", exp.buf.tobytes()), "exp.wcodec")
    try:
        model = load(path, verify=verify, workers=1)
    except (errors.CorruptStreamError, errors.ChecksumError) as err:
        assert str(err).startswith(str(path))
        assert verify or type(err) is errors.CorruptStreamError
    else:
        if verify:
            bit_exact(small_state_dict, model.state_dict)


# --- errors through worker processes, pickling -------------------------------------------------


def test_error_from_a_worker_process_keeps_class_and_path(small_archive, write_archive) -> None:
    expect(errors.ChecksumError, write_archive(_flip_in_stream(small_archive, FP32, "exp")), workers=2)
    exp = Exp(small_archive, BF16)
    exp.seg_words[0] -= 1
    bad = small_archive.with_stream(BF16, "exp", exp.buf.tobytes())
    expect(errors.CorruptStreamError, write_archive(bad), workers=2)


@pytest.mark.parametrize("cls", [errors.CodecError, errors.NotAWcodecFile, errors.UnsupportedVersion,
                                 errors.TruncatedFile, errors.HeaderError, errors.ChecksumError,
                                 errors.CorruptStreamError, errors.SourceError, errors.UnsupportedTensor])
def test_errors_pickle(cls) -> None:
    err = pickle.loads(pickle.dumps(cls("/x/y.wcodec", "what went wrong")))
    assert type(err) is cls and err.path == "/x/y.wcodec" and str(err) == "/x/y.wcodec: what went wrong"


# --- bad inputs to the encoder -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32])
def test_unsupported_dtype_leaves_no_file(tmp_path: Path, dtype: torch.dtype) -> None:
    dst = tmp_path / "out.wcodec"
    state = {"w": torch.zeros(5000, dtype=torch.bfloat16), "bad": torch.zeros(4, dtype=dtype)}
    with pytest.raises(errors.CodecError) as info:
        compress_state_dict(state, dst, workers=1)
    assert type(info.value) is errors.UnsupportedTensor
    assert info.value.path is not None and str(info.value).startswith(info.value.path)
    assert "bad" in str(info.value)
    assert list(tmp_path.iterdir()) == []                      # neither dst nor dst.tmp


def test_compress_missing_source(tmp_path: Path) -> None:
    src = tmp_path / "nowhere"
    with pytest.raises(errors.CodecError) as info:
        compress(src, tmp_path / "out.wcodec", workers=1)
    assert type(info.value) is errors.SourceError
    assert str(info.value).startswith(str(src))
    assert not (tmp_path / "out.wcodec").exists()
