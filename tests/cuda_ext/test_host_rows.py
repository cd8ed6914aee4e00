"""gather_host_rows, the embedding gather of a table kept in host memory: the C++ twin against the
reference (bit for bit, as 16-bit words: the tables hold NaN patterns), ids outside the table as
rows of zeros, its argument checks, and torch.library.opcheck. tests/gpu/test_host_rows_cuda.py
runs the same cases on the kernel reading page-locked memory."""
from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import ops


@pytest.fixture(scope="module", autouse=True)
def twin():
    avail = cuda_ext.available()
    assert avail.cpp and ops.has_ops(ops.HOST_ROWS_OPS, "cpu"), f"the C++ twin must build in CI: {avail.reason}"


def words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def check_cases(device: str) -> None:
    for table, ids, out in ops.sample_host_rows_inputs(device):
        want = torch.full_like(out, 7)
        ops.reference_gather_host_rows(table, ids, want)
        out.fill_(9)
        ops.gather_host_rows(table, ids, out)
        assert torch.equal(words(out.cpu()), words(want.cpu()))
        for i, id_ in enumerate(ids.tolist()):
            row = table[id_] if 0 <= id_ < table.shape[0] else torch.zeros_like(table[0])
            assert torch.equal(words(out[i].cpu()), words(row))


def test_the_twin_gathers_rows_and_zeros_outside_the_table() -> None:
    check_cases("cpu")


def test_opcheck_cpu() -> None:
    for args in ops.sample_host_rows_inputs("cpu"):
        torch.library.opcheck(torch.ops.wcodec.gather_host_rows.default, args)


@pytest.mark.parametrize("bad", ["ids dtype", "out shape", "out dtype", "table rank"])
def test_caller_mistakes_raise(bad: str) -> None:
    table, ids = torch.zeros(4, 8, dtype=torch.bfloat16), torch.tensor([1, 2])
    out = torch.empty(2, 8, dtype=torch.bfloat16)
    args = {"ids dtype": (table, ids.int(), out), "out shape": (table, ids, out[:1]),
            "out dtype": (table, ids, out.half()), "table rank": (table.view(-1), ids, out)}[bad]
    with pytest.raises(RuntimeError, match="gather_host_rows"):
        ops.gather_host_rows(*args)
