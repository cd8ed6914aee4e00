"""gather_host_rows on the CUDA kernel (host_rows.cu), the table page-locked on the host: the
twin's cases, fuzzed ids over a 7B-shaped table (32000 x 4096 bf16), the replay of a captured
CUDA graph with new ids (the decode step's use), and a table that is not page-locked refused."""
from __future__ import annotations

import pytest
import torch

from cuda_ext import ops
from tests.cuda_ext.test_host_rows import check_cases, words


def test_the_twins_cases_on_the_gpu() -> None:
    check_cases("cuda")


def test_fuzzed_ids_over_a_7b_table_match_the_twin() -> None:
    g = torch.Generator().manual_seed(11)
    table = torch.randint(-2**15, 2**15, (32000, 4096), generator=g, dtype=torch.int16).view(torch.bfloat16)
    pinned = table.pin_memory()
    for n in (1, 7, 64, 2048):
        ids = torch.randint(-3, 32003, (n,), generator=g)
        want = torch.empty(n, 4096, dtype=torch.bfloat16)
        ops.gather_host_rows(table, ids, want)                                      # the twin
        got = torch.empty(n, 4096, dtype=torch.bfloat16, device="cuda")
        ops.gather_host_rows(pinned, ids.cuda(), got)
        assert torch.equal(words(got.cpu()), words(want))


def test_a_captured_gather_reads_the_ids_of_each_replay() -> None:
    table = torch.arange(50 * 64, dtype=torch.float32).view(50, 64).to(torch.bfloat16).pin_memory()
    ids = torch.tensor([1, 2, 3], device="cuda")
    out = torch.empty(3, 64, dtype=torch.bfloat16, device="cuda")
    ops.gather_host_rows(table, ids, out)                                           # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gather_host_rows(table, ids, out)
    for new in ([49, 0, 7], [5, 5, 60]):
        ids.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.stack([table[i] if i < 50 else torch.zeros(64, dtype=torch.bfloat16) for i in new])
        assert torch.equal(out.cpu(), want)


def test_a_pageable_table_is_refused() -> None:
    table = torch.zeros(4, 8, dtype=torch.bfloat16)
    out = torch.empty(1, 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="page-locked"):
        ops.gather_host_rows(table, torch.tensor([0], device="cuda"), out)


def test_the_fake_takes_the_cuda_inputs() -> None:
    """The fake registration under FakeTensorMode with the CUDA inputs (what torch.compile traces).
    opcheck runs the real op on clones of the inputs, and a clone of a page-locked tensor is not
    page-locked, so the op refuses its table (as above, H200 2026-11-28): the CPU's opcheck runs
    every check (tests/cuda_ext/test_host_rows.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    for args in ops.sample_host_rows_inputs("cuda"):
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(a) for a in args]
            assert torch.ops.wcodec.gather_host_rows.default(*fake) is None
            assert fake[2].device.type == "cuda" and fake[0].device.type == "cpu"
