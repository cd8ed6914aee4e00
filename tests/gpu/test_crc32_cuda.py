"""crc32_spans on the CUDA kernels (crc32.cu) against zlib: the twin's cases (tests/cuda_ext/test_crc32.py)
on the device, fuzzed spans over a large buffer (three passes' worth of folds), and a stream-ordered
launch that reads bytes copied on the same stream."""
from __future__ import annotations

import numpy as np
import torch

from cuda_ext import ops
from tests.cuda_ext.test_crc32 import EDGES, UNIT, check, edge_spans, zlib_crcs


def test_edges_match_zlib_on_the_gpu() -> None:
    rng = np.random.default_rng(3)
    data = torch.from_numpy(rng.integers(0, 256, size=max(EDGES) + 64, dtype=np.uint8)).cuda()
    check(data, edge_spans(data.numel()))


def test_fuzzed_spans_match_zlib_and_the_twin() -> None:
    rng = np.random.default_rng(5)
    host = torch.from_numpy(rng.integers(0, 256, size=(300 << 20) + 13, dtype=np.uint8))
    data = host.cuda()
    for trial in range(4):
        n = int(rng.integers(1, 400))
        starts = rng.integers(0, host.numel(), size=n)
        lens = [int(rng.integers(0, min(host.numel() - s, [64, UNIT * 3, 1 << 24, 1 << 28][trial]) + 1))
                for s in starts]
        spans = torch.tensor(list(zip(starts.tolist(), lens)), dtype=torch.int64)
        got = ops.crc32_spans(data, spans)
        assert got.tolist() == zlib_crcs(host, spans)
        assert torch.equal(got.cpu(), ops.crc32_spans(host, spans))


def test_one_span_of_everything_and_a_flipped_bit() -> None:
    data = torch.randint(0, 256, ((256 * UNIT) * 3 + 999,), dtype=torch.uint8, device="cuda",
                         generator=torch.Generator("cuda").manual_seed(1))
    spans = torch.tensor([[0, data.numel()], [7, data.numel() - 7]], dtype=torch.int64)
    check(data, spans)
    data[data.numel() // 3] ^= 1
    check(data, spans)


def test_ordered_after_a_copy_on_the_current_stream() -> None:
    host = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        data = torch.empty_like(host, device="cuda")
        data.copy_(host, non_blocking=True)
        got = ops.crc32_spans(data, torch.tensor([[0, host.numel()]], dtype=torch.int64))
    stream.synchronize()
    assert got.tolist() == zlib_crcs(host, torch.tensor([[0, host.numel()]]))
