"""crc32_spans, the parallel CRC-32 (cuda_ext/csrc/crc32.h) that CUDA loads verify streams with: the
C++ twin runs the kernels' passes a block at a time, so here it is checked against zlib at the
sizes where the passes' padding and folds change (empty, under a word, a piece, a 64 KiB unit, a
256-unit fold), at every alignment, and through torch.library.opcheck. tests/gpu/test_crc32_cuda.py
runs the same cases on the kernels."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import cuda_ext
from cuda_ext import ops

UNIT = 1 << 16
EDGES = (0, 1, 2, 3, 4, 5, 7, 8, 255, 256, 257, 4095, UNIT - 1, UNIT, UNIT + 1, 3 * UNIT + 129,
         256 * UNIT - 1, 256 * UNIT, 256 * UNIT + 1, 300 * UNIT + 77)


@pytest.fixture(scope="module", autouse=True)
def twin():
    avail = cuda_ext.available()
    assert avail.cpp and ops.has_ops(ops.CHECKSUM_OPS, "cpu"), f"the C++ twin must build in CI: {avail.reason}"


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    rng = np.random.default_rng(3)
    return torch.from_numpy(rng.integers(0, 256, size=max(EDGES) + 64, dtype=np.uint8))


def edge_spans(n_bytes: int) -> torch.Tensor:
    """Every edge length at offsets 0-3 and an odd one, where it fits."""
    rows = [[off, n] for n in EDGES for off in (0, 1, 2, 3, 61) if off + n <= n_bytes]
    return torch.tensor(rows, dtype=torch.int64)


def zlib_crcs(data: torch.Tensor, spans: torch.Tensor) -> list[int]:
    buf = data.cpu().numpy()
    return [zlib.crc32(buf[off:off + n]) for off, n in spans.tolist()]


def check(data: torch.Tensor, spans: torch.Tensor) -> None:
    got = ops.crc32_spans(data, spans)
    assert got.device == data.device and got.dtype == torch.int64
    assert got.tolist() == zlib_crcs(data, spans)


def test_edges_match_zlib(data) -> None:
    check(data, edge_spans(data.numel()))


@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_constant_bytes(fill: int) -> None:
    buf = torch.full((3 * UNIT + 5,), fill, dtype=torch.uint8)
    check(buf, torch.tensor([[0, 0], [0, 1], [1, 4], [0, buf.numel()], [5, 2 * UNIT]], dtype=torch.int64))


def test_random_spans_and_a_flip_is_seen(data) -> None:
    rng = np.random.default_rng(11)
    starts = rng.integers(0, data.numel() // 2, size=40)
    spans = torch.tensor([[s, rng.integers(0, data.numel() - s)] for s in starts], dtype=torch.int64)
    check(data, spans)
    before = ops.crc32_spans(data, spans)
    flipped = data.clone()
    flipped[int(starts[0]) + int(spans[0, 1]) // 2] ^= 0x10
    after = ops.crc32_spans(flipped, spans)
    assert after[0] != before[0]
    assert after.tolist() == zlib_crcs(flipped, spans)


def test_no_spans(data) -> None:
    assert ops.crc32_spans(data, torch.empty(0, 2, dtype=torch.int64)).numel() == 0


@pytest.mark.parametrize("span", [[-1, 4], [0, -1], [10, 1 << 40], [1 << 62, 1 << 62]])
def test_spans_outside_data_are_refused(data, span) -> None:
    with pytest.raises(RuntimeError, match="lies outside data"):
        ops.crc32_spans(data, torch.tensor([span], dtype=torch.int64))


def test_bad_arguments_are_refused(data) -> None:
    with pytest.raises(RuntimeError, match="spans must be"):
        ops.crc32_spans(data, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="data must be"):
        ops.crc32_spans(data.view(torch.int8), torch.tensor([[0, 1]], dtype=torch.int64))


def test_reference_and_dispatcher_agree(data) -> None:
    spans = edge_spans(data.numel())[:25]
    assert torch.equal(ops.reference_crc32_spans(data, spans), cuda_ext.crc32_spans(data, spans))


def test_opcheck(data) -> None:
    torch.library.opcheck(torch.ops.wcodec.crc32_spans.default, (data[:5000], edge_spans(5000)))
