"""The fixed-rate form's CUDA ops against the reference and the C++ twin: the GPU transcoder's
arrays bit for bit, the kernel's decode (debug entry point) bit for bit, the fused matmul's error
against float32 on the decoded weights within 2x cuBLAS bf16's own, CUDA-graph capture, opcheck."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuda_ext import fixedrate as fr_ops
from cuda_ext import ops
from tests.tensors import make_tensor

SHAPES = [(1, 1), (3, 31), (2, 33), (5, 127), (4, 129), (7, 1000), (3, 1024), (2, 4096 + 160), (40, 2049), (300, 4096)]


def assert_same_arrays(got, want):
    for name, g, w in zip(fr_ops.ARRAYS, got, want):
        assert g.shape == w.shape and torch.equal(g.cpu(), w), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bits", "normal", "mixed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_transcoder_and_decode_are_bit_exact(dtype, kind, shape):
    w = make_tensor(dtype, shape, seed=sum(shape) + 2, kind=kind)
    got = ops.fixedrate_encode(w.cuda())
    assert_same_arrays(got, fr_ops.reference_encode(w))
    assert_same_arrays(got, ops.fixedrate_encode(w))                # the C++ twin
    out = torch.full(shape, 7.0, dtype=dtype, device="cuda")        # poisoned
    ops.fixedrate_decode(*got, shape[1], out)
    assert torch.equal(out.cpu().view(torch.int16), w.view(torch.int16))


def test_every_16_bit_pattern_through_the_gpu():
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).reshape(128, 512)
    for order in (w, w.T.contiguous()):
        bf = order.view(torch.bfloat16)
        fr = fr_ops.encode(bf.cuda())
        assert_same_arrays(list(fr.arrays), fr_ops.reference_encode(bf))
        assert torch.equal(fr_ops.decode(fr).cpu().view(torch.int16), order)


def trained_like(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = 0.02 * torch.exp(0.35 * torch.randn(rows, 1, generator=g, device="cuda"))
    w = torch.randn(rows, cols, generator=g, device="cuda") * scale
    return torch.where(torch.rand(rows, cols, generator=g, device="cuda") < 1e-4, w * 8, w).bfloat16()


WEIGHTS = {"random": lambda r, c, s: fr_ops.sample_weight(torch.bfloat16, r, c, s, finite=True).cuda(),
           "trained": trained_like,
           "fp16": lambda r, c, s: fr_ops.sample_weight(torch.float16, r, c, s, finite=True).cuda()}


@pytest.mark.parametrize("kernel", [0, 1])                   # tensor cores, CUDA cores
@pytest.mark.parametrize("kind", list(WEIGHTS))
@pytest.mark.parametrize("shape", [(1024, 4096), (96, 1000), (300, 4095), (33, 14336 + 17), (8, 31), (13, 64),
                                   (4100, 3072 + 5)])                # K in 6 ranges, CTAs of 6 warps (128+ SMs)
def test_fused_error_within_twice_cublas(kernel, kind, shape):
    w = WEIGHTS[kind](*shape, sum(shape))
    fr = fr_ops.encode(w)
    decoded = fr_ops.decode(fr)
    assert torch.equal(decoded.view(torch.int16), w.view(torch.int16))
    for n in list(range(1, 17)) + ([17, 24, 31, 32, 33, 48, 63, 64] if kernel == 0 else []):
        x = torch.randn(n, shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).to(w.dtype)
        ref = x.double() @ decoded.double().T
        ours, cublas = fr_ops.linear(x, fr, kernel), F.linear(x, decoded)
        assert ours.shape == (n, shape[0]) and torch.isfinite(ours).all()
        err, base = (ours.double() - ref).abs().max().item(), (cublas.double() - ref).abs().max().item()
        assert err <= 2 * base + 1e-30, (n, err, base)


def spread_exponents(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Finite weights whose exponents spread over 40 values: most escape, a block's escapes run far
    past the kernels' windows (32 entries a block, 4 a tile), so their slow path runs too."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = torch.randint(100, 140, (rows, cols), generator=g, device="cuda")
    m = torch.randint(0, 256, (rows, cols), generator=g, device="cuda")      # sign and mantissa
    return ((m & 0x80) << 8 | e << 7 | (m & 0x7F)).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("kernel", [0, 1])
def test_escapes_past_the_windows_and_at_any_alignment(kernel):
    """Most weights escaping, and the escape array at other offsets in its allocation (a row view
    of a joined weight keeps the joined esc; a slice may start at any entry): bit-exact decode, the
    fused output the same bits whatever esc's address, within 2x cuBLAS's error."""
    w = spread_exponents(40, 4096 + 96, 3)
    fr = fr_ops.encode(w)
    assert fr.esc.numel() > 0.7 * w.numel()
    for shift in range(3):
        esc = torch.cat([torch.zeros(shift, dtype=torch.int16, device="cuda"), fr.esc])[shift:]
        moved = fr_ops.FixedRateWeight(fr.rows, fr.cols, fr.dtype, fr.plane, fr.lo, fr.hi, fr.tile, esc, fr.esc_start)
        assert torch.equal(fr_ops.decode(moved).view(torch.int16), w.view(torch.int16)), shift
        for n in ([1, 4, 16] if kernel == 1 else [1, 4, 8, 16, 17, 32, 64]):     # 8: W as the mma's A
            x = torch.randn(n, fr.cols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).bfloat16()
            ours = fr_ops.linear(x, moved, kernel)
            assert torch.equal(ours.view(torch.int16), fr_ops.linear(x, fr, kernel).view(torch.int16)), (shift, n)
            ref = x.double() @ w.double().T
            err, base = (ours.double() - ref).abs().max().item(), (F.linear(x, w).double() - ref).abs().max().item()
            assert err <= 2 * base + 1e-30, (shift, n, err, base)


def test_row_views_of_a_joined_weight_multiply_as_their_parts():
    ws = [trained_like(rows, 4096, rows) for rows in (512, 128, 128)]
    joined = fr_ops.cat_rows([fr_ops.encode(w) for w in ws])
    for view, w in zip(fr_ops.row_views(joined, [512, 128, 128]), ws):
        alone = fr_ops.encode(w)
        for n in (1, 5, 16, 32):
            x = torch.randn(n, 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).bfloat16()
            assert torch.equal(fr_ops.linear(x, view).view(torch.int16), fr_ops.linear(x, alone).view(torch.int16))


@pytest.mark.parametrize("shape", [(1024, 4096), (64, 4096 + 160), (37, 1000), (4096, 1024), (6000, 4096 + 160),
                                   (16400, 1024), (6100, 2048), (4096, 4096 + 160)])
def test_tensor_core_rows_same_alone_as_in_a_batch(shape):
    """K is cut by the matrix's shape alone (into tiles' ranges, some starting inside an escape
    block, summed across CTAs where a matrix has few rows): a row of x gets the same bits in a batch
    of any size as alone, through every path: x as B (2 rows), W as A (5, 6), x permuted as A (7-16),
    wide_kernel (17-64). From 17 to 40 rows, 6000 rows take CTAs of 6 warps on a GPU of up to 187
    SMs (47 · 4 CTAs of 8 warps would not fit at once), 16 400 rows (2 ranges) CTAs of 5 on 132 SMs
    (2 waves of 5 as of 6), the others CTAs of 8. From 7 to 16 rows, 6100 rows take 6 CTAs an SM on
    132 SMs (763 CTAs: 2 waves at 5, 1 at 6). 4 096 rows of 34 tiles take 6 ranges of K on a GPU of
    128 SMs or more, in CTAs of 6 warps up to 16 rows and from 17 (wide_kernel's rule), and from 41
    rows 4 where 6 would take more waves (two on 132 SMs): the same bits in any batch of 1-40 rows
    and in any of 41-64, each against its class's first batch."""
    w = trained_like(*shape, sum(shape))
    fr = fr_ops.encode(w)
    x = torch.randn(64, shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).bfloat16()
    alone = torch.cat([fr_ops.linear(x[i:i + 1], fr, 0) for i in range(64)])
    wide = fr_ops.linear(x, fr, 0)                                      # 41-64 rows: one cut of K
    for n in (2, 5, 6, 7, 8, 9, 16, 17, 24, 32, 33, 40, 41, 48, 56, 63):   # from 17: wide_kernel, 3-8 n8 tiles
        first = alone if n <= 40 else wide
        assert torch.equal(fr_ops.linear(x[:n], fr, 0).view(torch.int16), first[:n].view(torch.int16)), n
    if shape[0] != 4096:                                                # the others: one cut at every row count
        assert torch.equal(wide.view(torch.int16), alone.view(torch.int16))


@pytest.mark.parametrize("shape", [(1024, 4096), (300, 4095), (37, 1000), (6100, 2048)])
def test_x_in_the_kernels_layout_gives_the_same_bits(shape):
    """x handed over in the layout the kernel reads at its row count (fixedrate.permute, one m16 tile
    or n8 tiles): the op launches no permute of its own and gives fixedrate_linear's y bit for bit,
    at every row count that takes a layout."""
    fr = fr_ops.encode(fr_ops.sample_weight(torch.bfloat16, *shape, seed=shape[0], finite=True).cuda())
    with fr_ops.fused_rows(fr_ops.FUSED_MAX_ROWS):
        for n in (7, 12, 16, 17, 24, 31, 40, 57, 64):
            x = fr_ops.padded_x(n, fr, n)[:, :fr.cols].cuda()
            permuted = fr_ops.permute(x)
            assert permuted.data.shape == (fr_ops.permuted_rows(n), fr_ops.permuted_cols(fr.cols))
            assert torch.equal(fr_ops.linear(permuted, fr), fr_ops.linear(x, fr)), n
    with pytest.raises(RuntimeError, match="permuted x: contiguous"):
        ops.fixedrate_linear_permuted(permuted.data[:, :-128].contiguous(), 64, *fr.arrays, fr.cols)
    with pytest.raises(RuntimeError, match="a permuted x holds 7 to 64 rows"):
        ops.fixedrate_linear_permuted(permuted.data, 6, *fr.arrays, fr.cols)


def test_more_than_64_rows_decode_then_cublas():
    w = trained_like(512, 1000, 1)
    fr = fr_ops.encode(w)
    x = torch.randn(5, 16, 1000, device="cuda").bfloat16()
    assert torch.equal(fr_ops.linear(x, fr), F.linear(x, w))
    big = trained_like(5000, 4096, 2)                                   # decoded in L2-sized row chunks
    fr = fr_ops.encode(big)
    x = torch.randn(96, 4096, device="cuda").bfloat16()
    ref = x.double() @ big.double().T
    err, base = (fr_ops.linear(x, fr).double() - ref).abs().max(), (F.linear(x, big).double() - ref).abs().max()
    assert err <= 2 * base


def test_usable_in_a_cuda_graph():
    w = trained_like(2048, 4096, 2)
    fr = fr_ops.encode(w)
    xs = {n: torch.randn(n, 4096, device="cuda").bfloat16() for n in (1, 7, 16, 40, 64, 80)}
    outs = {}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for n, x in xs.items():
            fr_ops.linear(x, fr)                                    # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for n, x in xs.items():
            outs[n] = fr_ops.linear(x, fr)
            outs[-n] = fr_ops.linear(x, fr, 1) if n <= 16 else outs[n]
    for x in xs.values():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for n, x in xs.items():
        assert torch.equal(outs[n], fr_ops.linear(x, fr)), n
        assert torch.equal(outs[-n], fr_ops.linear(x, fr, 1) if n <= 16 else outs[n]), n


@pytest.mark.parametrize("n", [1, 3, 6, 16, 24, 40])
def test_a_chain_reads_each_output_after_it_is_written(n):
    """Each fused linear reads the one before's output, launched while that one ends (programmatic
    dependent launch on sm_90+): eager and replayed in a CUDA graph, a chain equals the same calls
    with a device sync between them, bit for bit. Through row counts of every path (x in place, W as
    A, x permuted first, decode + cuBLAS) and matrices whose K is cut across CTAs (1 024 rows)."""
    shapes = [(4096, 4096), (1024, 4096), (4096, 1024), (3000, 4096), (4096, 3000), (1000, 4096), (4096, 1000)]
    forms = [fr_ops.encode(trained_like(r, c, r + c)) for r, c in shapes]
    x0 = torch.randn(n, 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).bfloat16()

    def chain():
        x = x0
        for f in forms:
            x = fr_ops.linear(x, f)
        return x

    ref = x0
    for f in forms:
        ref = fr_ops.linear(ref, f)
        torch.cuda.synchronize()
    assert torch.equal(chain(), ref)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()                                                     # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_opcheck_cuda():
    for name, args in fr_ops.sample_inputs("cuda"):
        torch.library.opcheck(getattr(torch.ops.wcodec, name).default, args)
