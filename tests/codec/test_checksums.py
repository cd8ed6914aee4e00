"""Format 1.1 checksums: every blob record carries "xxh3" beside "crc32"; readers check "xxh3"
when present, else "crc32", so a 1.0 archive (no "xxh3") still reads and is still verified."""
from __future__ import annotations

import re

import pytest

from codec import container, errors
from codec.constants import FORMAT_MAJOR
from codec.decode import load

BF16 = "model.embed_tokens.weight"


def _records(header: dict) -> list[dict]:
    return [*header["files"].values(), *(s for t in header["tensors"] for s in t["streams"].values())]


def test_writer_stamps_version_and_both_checksums(small_archive) -> None:
    assert (small_archive.preamble.major, small_archive.preamble.minor) == (FORMAT_MAJOR, container.CHECKSUM_MINOR)
    assert small_archive.header["version"] == f"{FORMAT_MAJOR}.{container.CHECKSUM_MINOR}"
    recs = [s for t in small_archive.header["tensors"] for s in t["streams"].values()]
    assert recs and all(re.fullmatch(r"[0-9a-f]{16}", r["xxh3"]) for r in recs)
    for t in small_archive.header["tensors"]:
        for role in t["streams"]:
            data = small_archive.stream(t["name"], role)
            assert t["streams"][role]["xxh3"] == container.xxh3(data)
            assert t["streams"][role]["crc32"] == container.crc32(data)


def _as_format_1_0(archive, region: bytes | None = None) -> bytes:
    header = archive.header
    for rec in _records(header):
        del rec["xxh3"]
    header["version"] = f"{FORMAT_MAJOR}.0"
    data = archive.with_header(header, region)
    pre = container._PREAMBLE.unpack(data[:container._PREAMBLE.size])
    return container.Preamble(pre[1], 0, pre[4], pre[5], pre[6], pre[8], pre[9]).pack() + data[64:]


def _flip(archive, name: str, role: str) -> bytes:
    rec = archive.tensor(name)["streams"][role]
    region = bytearray(archive.region)
    region[rec["offset"] - 64 + rec["length"] // 2] ^= 0x10
    return bytes(region)


def test_format_1_0_archive_reads_and_is_checked_by_crc32(small_archive, small_state_dict, write_archive,
                                                           bit_exact) -> None:
    bit_exact(load(write_archive(_as_format_1_0(small_archive)), workers=1).state_dict, small_state_dict)
    bad = write_archive(_as_format_1_0(small_archive, _flip(small_archive, BF16, "hi")))
    with pytest.raises(errors.ChecksumError, match="hi.*CRC32"):
        load(bad, workers=1)


def test_flipped_byte_fails_xxh3(small_archive, write_archive) -> None:
    bad = write_archive(small_archive.with_header(small_archive.header, _flip(small_archive, BF16, "exp")))
    with pytest.raises(errors.ChecksumError, match=f"{BF16}.*XXH3-64"):
        load(bad, workers=1)


@pytest.mark.parametrize("value", ["0" * 16, "XYZ", 12345, "0" * 15])
def test_wrong_or_malformed_xxh3_fails(small_archive, write_archive, value) -> None:
    header = small_archive.header
    small_archive.tensor(BF16, header)["streams"]["hi"]["xxh3"] = value
    with pytest.raises(errors.ChecksumError, match="XXH3-64"):
        load(write_archive(small_archive.with_header(header)), workers=1)


def test_xxh3_is_authoritative_when_present(small_archive, small_state_dict, write_archive, bit_exact) -> None:
    """A 1.1 reader checks one checksum per blob: a stale crc32 beside a right xxh3 passes."""
    header = small_archive.header
    small_archive.tensor(BF16, header)["streams"]["hi"]["crc32"] ^= 1
    bit_exact(load(write_archive(small_archive.with_header(header)), workers=1).state_dict, small_state_dict)


def test_checksum_fault_names_what_fails() -> None:
    data = b"abc" * 1000
    assert container.checksum_fault(data, container.checksums(data)) is None
    assert container.checksum_fault(data, {"crc32": container.crc32(data)}) is None
    assert container.checksum_fault(data + b"x", {"crc32": container.crc32(data)}) == "CRC32"
    assert container.checksum_fault(data + b"x", container.checksums(data)) == "XXH3-64"


def test_blob_checksums_take_a_producers_crc32() -> None:
    """A Summed blob keeps the CRC32 its producer gave (the GPU coder's); xxh3 is always taken here."""
    data = bytes(range(256)) * 9
    view, sums = container.blob_checksums(data)
    assert bytes(view) == data and sums == container.checksums(data)
    view, sums = container.blob_checksums(container.Summed(data, 12345))
    assert bytes(view) == data and sums == {"crc32": 12345, "xxh3": container.xxh3(data)}
