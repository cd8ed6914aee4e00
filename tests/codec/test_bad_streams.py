"""Bad archives, continued: streams whose CRCs are valid but whose contents lie -- malformed
directories and tables, swapped or missing words -- plus fuzzers over whole archives. Every
failure is one exact CodecError subclass; never an IndexError, a crash or a hang."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from bad_input_helpers import BF16, FP32, INTS, expect, flip_in_stream
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import errors
from codec.constants import (
    PREAMBLE_SIZE,
    SEGMENT_ALIGN,
    SEGMENT_SYMBOLS,
    STATE_BYTES,
)
from codec.decode import load
from codec.encode import compress, compress_state_dict
from codec.floatcodec import FloatParams

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
    """Shorter than its directory and its segments' states: the header's own lengths refuse it,
    before any decoder (or any output buffer) sees it."""
    bad = small_archive.with_stream(BF16, "exp", small_archive.stream(BF16, "exp")[:size])
    err = expect(errors.HeaderError, write_archive(bad))
    assert "shorter than the segments its shape needs" in str(err)


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
    expect(errors.ChecksumError, write_archive(flip_in_stream(small_archive, FP32, "exp")), workers=2)
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
