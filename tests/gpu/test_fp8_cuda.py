"""The W8A16 kernel (cuda_ext/csrc/fp8_linear.cu) against the C++ twin and float64: its decode bit
for bit on every byte and on fuzzed matrices, the product's error within cuBLAS bf16's own on the
dequantized weights (decoded mode's), every scale grid and ragged shape, a row's bits the same in
any batch of one kernel's rows, CUDA-graph capture, opcheck."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuda_ext import fp8

# (N, K, block): per row, per tensor, 128 x 128 blocks (ragged both ways), an 8B's k/v and down shapes
GRIDS = [(40, 336, (1, 336)), (130, 272, (130, 272)), (300, 400, (128, 128)), (1024, 4096, (1, 4096)),
         (4096, 14336, (128, 128)), (100, 48, (1, 48)), (16, 16, (16, 16))]


def test_every_byte_and_fuzzed_matrices_decode_as_the_twin():
    w = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(fp8.to_bf16(w.cuda()).cpu().view(torch.int16), fp8.to_bf16(w).view(torch.int16))
    g = torch.Generator().manual_seed(0)
    for shape in ((1,), (3,), (5, 7), (333, 1001), (4096, 4096)):
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        got = fp8.to_bf16(b.cuda()).cpu()
        assert torch.equal(got.view(torch.int16), fp8.to_bf16(b).view(torch.int16)), shape


def _case(n, k, block, m, seed):
    g = torch.Generator().manual_seed(seed)
    w = fp8.sample_weight(n, k, seed=seed)
    scale = torch.rand((-(-n // block[0]), -(-k // block[1])), generator=g) / 64 + 1e-3
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, w, scale


def _dequantized(w, scale, block):
    rows = scale.repeat_interleave(block[0], 0)[:w.shape[0]]
    cols = rows.repeat_interleave(block[1], 1)[:, :w.shape[1]]
    return (w.view(torch.float8_e4m3fn).float() * cols).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k", "block"), GRIDS)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 9, 16, 17, 32, 33, 64])
def test_the_product_errs_no_more_than_cublas_on_decoded_weights(n, k, block, m):
    x, w, scale = _case(n, k, block, m, seed=n + k + m)
    want = fp8.reference(x, w, scale, block)                                     # float64 [m, n]
    got = fp8.linear(x.cuda(), w.cuda(), scale.cuda(), block).cpu().double()
    cublas = F.linear(x.cuda(), _dequantized(w, scale, block).cuda()).cpu().double()
    twin = fp8.linear(x, w, scale, block).double()
    err, err_cublas, err_twin = ((t - want).abs() for t in (got, cublas, twin))
    assert float(err.max()) <= 2 * float(err_cublas.max()) + 1e-30, (err.max(), err_cublas.max())
    assert float(err.max()) <= 2 * float(err_twin.max()) + 1e-30, (err.max(), err_twin.max())


@pytest.mark.parametrize("block", [(128, 128), (1, 4096)])
def test_a_rows_bits_do_not_depend_on_its_batch_within_a_kernels_rows(block):
    """1..16 rows take one kernel and 17..64 the other (fp8_linear.cu): a row's bits are the same in
    any batch of the same kernel."""
    x, w, scale = _case(4096, 4096, block, 64, seed=5)
    x, w, scale = x.cuda(), w.cuda(), scale.cuda()
    for rows, sizes, singles in ((16, (1, 3, 8, 9, 15), (0, 5, 15)), (64, (17, 31, 32, 33, 50), ())):
        whole = fp8.linear(x[:rows].contiguous(), w, scale, block)
        for m in sizes:
            assert torch.equal(fp8.linear(x[:m].contiguous(), w, scale, block), whole[:m]), m
        for r in singles:
            assert torch.equal(fp8.linear(x[r:r + 1].contiguous(), w, scale, block), whole[r:r + 1]), r
    tail = fp8.linear(x[40:57].contiguous(), w, scale, block)                # 17 rows from the middle
    assert torch.equal(tail, fp8.linear(x, w, scale, block)[40:57])


@pytest.mark.parametrize(("n", "k", "block"), GRIDS + [(64, 96, (32, 48))])
def test_dequantize_is_the_twins_and_decoded_modes_bit_for_bit(n, k, block):
    w, scale = fp8.sample_weight(n, k, seed=n), torch.rand(-(-n // block[0]), -(-k // block[1])) / 64
    w[w & 0x7F == 0x7F] = 0                                                     # NaN bytes are never kept
    got = fp8.dequantize(w.cuda(), scale.cuda(), block).cpu()
    assert torch.equal(got.view(torch.int16), fp8.dequantize(w, scale, block).view(torch.int16))
    assert torch.equal(got.view(torch.int16), _dequantized(w, scale, block).view(torch.int16))


def test_usable_in_a_cuda_graph():
    x, w, scale = (t.cuda() for t in _case(1024, 4096, (1, 4096), 4, seed=7))
    eager = fp8.linear(x, w, scale, (1, 4096))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8.linear(x, w, scale, (1, 4096))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8.linear(x, w, scale, (1, 4096))
    x.copy_(x.flip(0))
    graph.replay()
    assert torch.equal(y, fp8.linear(x, w, scale, (1, 4096))) and not torch.equal(y, eager)


def test_cuda_refuses_what_it_does_not_take():
    w, scale = torch.zeros(32, 64, dtype=torch.uint8, device="cuda"), torch.ones(32, 1, device="cuda")
    with pytest.raises(RuntimeError, match="1..64 rows"):
        fp8.linear(torch.zeros(65, 64, dtype=torch.bfloat16, device="cuda"), w, scale, (1, 64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        fp8.linear(torch.zeros(1, 40, dtype=torch.bfloat16, device="cuda"), w[:, :40].contiguous(), scale, (1, 40))


def test_opcheck_cuda():
    for name, args in fp8.sample_inputs("cuda"):
        torch.library.opcheck(getattr(torch.ops.wcodec, name).default, args)
