"""linear16 (cuda_ext/csrc/linear16.cpp), the CPU matmul of served bf16/fp16 Linears, against a
float64 matmul of the same values: within one rounding to the weight's dtype plus the float32 sums'
error bound; a row's result the same alone and batched (bit for bit); NaN and infinities where
the reference has them; clear errors. The FMA loop (AVX-512 without AVX512-BF16, and fp16) and the
scalar loop (WCODEC_CPU_SIMD=0) give cuda_ext/linear16.py's reference bit for bit."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cuda_ext import ops
from cuda_ext.linear16 import linear16_reference
from tests.cuda_ext.extension import require_cpu_ops

REPO = Path(__file__).resolve().parents[2]
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}     # unit roundoff of the output
# (rows, K, N): ragged K (pairs, 16- and 32-wide steps), ragged N (4-, 16- and 32-row blocks), rows
# past a 4- and 12-row tile, none
SHAPES = [(1, 1, 1), (1, 15, 3), (2, 16, 17), (3, 33, 31), (4, 64, 32), (5, 577, 33), (13, 1000, 40),
          (1, 576, 1536), (0, 64, 8), (25, 130, 65)]


@pytest.fixture(scope="module", autouse=True)
def extension():
    require_cpu_ops(ops.LINEAR16_OPS, "linear16")


def operands(rows: int, k: int, n: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1).to(dtype)   # rows of varied scale
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """|y - exact| <= u |exact| + 2 (K + 32) 2^-24 sum |x w| (+ |b| 2^-24): one rounding to the dtype
    after float32 sums of exact products (and float32 bias)."""
    xd, wd = x.double(), w.double()
    exact = xd @ wd.T + (0 if b is None else b.double())
    mass = xd.abs() @ wd.abs().T + (0 if b is None else b.double().abs())
    bound = UNIT[w.dtype] * exact.abs() + 2 * (x.shape[-1] + 32) * 2.0 ** -24 * mass + 1e-30
    err = (y.double() - exact).abs()
    assert y.dtype == w.dtype and y.shape == exact.shape
    assert bool((err <= bound).all()), f"worst {float((err - bound).max())} over the bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_within_one_rounding_of_the_exact_product(shape, dtype, bias):
    x, w, b = operands(*shape, dtype, seed=sum(shape), bias=bias)
    assert_within_bound(ops.linear16(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(13, 1000, 40), (25, 130, 65), (6, 576, 1536)])
def test_a_row_is_the_same_alone_and_batched(shape, dtype):
    x, w, b = operands(*shape, dtype, seed=7, bias=True)
    y = ops.linear16(x, w, b)
    for i in range(x.shape[0]):
        assert torch.equal(ops.linear16(x[i:i + 1], w, b)[0], y[i]), i
        assert torch.equal(ops.linear16(x[i:i + 3], w, b)[0], y[i]), i


def test_leading_dimensions_and_strided_x():
    x, w, b = operands(12, 96, 40, torch.bfloat16, seed=3, bias=True)
    y = ops.linear16(x, w, b)
    assert torch.equal(ops.linear16(x.view(3, 4, 96), w, b), y.view(3, 4, 40))
    wide = torch.cat([x, x], dim=1)[:, :96]                            # rows of x not contiguous
    assert torch.equal(ops.linear16(wide, w, b), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_and_infinities_where_the_reference_has_them(dtype):
    x, w, _ = operands(3, 40, 20, dtype, seed=5, bias=False)
    w[2, 7], w[5, 0], w[9, 39] = float("inf"), float("-inf"), float("nan")
    x[1, 3] = float("inf")
    want = torch.nn.functional.linear(x.double(), w.double())
    got = ops.linear16(x, w).double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()])


def loop(dtype: torch.dtype) -> str:
    return ops.linear16_loop(dtype) if ops.has_ops(ops.LOOP_OPS) else "none"


def same_bits(y: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN (their payloads are the CPU's)."""
    nan = want.isnan()
    return torch.equal(y.isnan(), nan) and torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_the_loop_follows_the_cpu():
    """linear16_loop names the loop a call runs: vdpbf16ps for bf16 on AVX512-BF16, FMAs on other
    AVX-512 CPUs (and for fp16), scalar without AVX-512."""
    assert ops.has_ops(ops.LOOP_OPS), "the extension lacks linear16_loop: rebuild it"
    simd = torch.backends.cpu.get_cpu_capability().startswith("AVX512") and os.environ.get("WCODEC_CPU_SIMD") != "0"
    bf16 = torch.cpu._is_avx512_bf16_supported()
    assert loop(torch.bfloat16) == ("vdpbf16ps" if simd and bf16 else "fma" if simd else "scalar")
    assert loop(torch.float16) == ("fma" if simd else "scalar")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES + [(29, 576, 96), (12, 1536, 64)])
def test_the_fma_loop_gives_the_reference_bit_for_bit(shape, dtype):
    """Every output's float32 sum in k order, each step rounded once, then the bias, then one
    rounding to the dtype: cuda_ext/linear16.py, bit for bit (specials in the last row)."""
    if loop(dtype) == "vdpbf16ps":
        pytest.skip("bf16 runs vdpbf16ps on this CPU (checked against the float64 bound)")
    x, w, b = operands(*shape, dtype, seed=sum(shape) + 1, bias=True)
    if shape[0] > 1 and shape[1] > 3:
        x[-1, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
        w[0, 1] = float("-inf")
    assert same_bits(ops.linear16(x, w, b), linear16_reference(x, w, b))


def test_each_step_is_rounded_once():
    """s = fl(s + w x) with the product unrounded (an FMA): products 2^-120, 2^-128 and
    2^-144 (1 + 2^-8 - 2^-15) sum to just above a bf16 tie, which rounds up; a product rounded
    to float32 on its own (2^-144, float32's subnormals) would leave an exact tie, rounded down."""
    if loop(torch.bfloat16) == "vdpbf16ps":
        pytest.skip("bf16 runs vdpbf16ps on this CPU (subnormal products flushed)")
    x = torch.tensor([[2.0 ** -60, 2.0 ** -64, 2.0 ** -72 * (1 - 2 ** -8)]]).bfloat16()
    w = torch.tensor([[2.0 ** -60, 2.0 ** -64, 2.0 ** -72 * (1 + 2 ** -7)]]).bfloat16()
    want = 2.0 ** -120 * (1 + 2 ** -7)
    assert linear16_reference(x, w).item() == want
    assert ops.linear16(x, w).item() == want
    assert (x.float() * w.float()).sum().bfloat16().item() == 2.0 ** -120              # rounded twice


def test_wide_exponents_give_the_reference_bit_for_bit():
    """Sums of products from 2^-150 to 2^120 (subnormal products and sums, cancellation)."""
    if loop(torch.bfloat16) == "vdpbf16ps":
        pytest.skip("bf16 runs vdpbf16ps on this CPU")
    g = torch.Generator().manual_seed(11)

    def wide(shape, lo, hi):
        e = torch.randint(lo, hi, shape, generator=g).double()
        return (torch.randn(shape, generator=g, dtype=torch.float64).sign() * (1 + torch.rand(shape, generator=g,
                dtype=torch.float64)) * 2.0 ** e).bfloat16()
    for lo, hi in ((-75, -45), (-70, 60)):
        x, w = wide((7, 96), lo, hi), wide((64, 96), lo, hi)
        assert same_bits(ops.linear16(x, w), linear16_reference(x, w)), (lo, hi)
        if SIMD:                                # packing needs AVX-512 (without it nothing packs: the scalar test)
            assert same_bits(ops.linear16_packed(x, ops.linear16_pack(w)), linear16_reference(x, w)), (lo, hi)


def test_the_scalar_loop_gives_the_reference_bit_for_bit():
    """WCODEC_CPU_SIMD=0 (read once a process): the loop a CPU without AVX-512 runs, the FMA
    loop's sums (std::fma), for both dtypes; linear16_loop says so, and nothing packs."""
    script = f"""
import torch, sys
sys.path.insert(0, {str(REPO)!r})
from cuda_ext import ops
from tests.cuda_ext.extension import require_cpu_ops
from tests.cuda_ext.test_linear16 import SHAPES, linear16_reference, operands, same_bits
require_cpu_ops(ops.LINEAR16_OPS, "linear16")
assert ops.linear16_loop(torch.bfloat16) == ops.linear16_loop(torch.float16) == "scalar"
for dtype in (torch.bfloat16, torch.float16):
    for shape in SHAPES:
        x, w, b = operands(*shape, dtype, seed=1, bias=True)
        y = ops.linear16(x, w, b)
        assert same_bits(y, linear16_reference(x, w, b)), (dtype, shape)
        assert all(torch.equal(ops.linear16(x[i:i + 1], w, b)[0], y[i]) for i in range(x.shape[0]))
try:
    ops.linear16_pack(torch.zeros(32, 32, dtype=torch.bfloat16))
except RuntimeError as e:
    assert "no AVX-512" in str(e)
else:
    raise AssertionError("packed without AVX-512")
print("scalar ok")
"""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "WCODEC_CPU_SIMD": "0"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and "scalar ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize(("args", "message"), [
    ((torch.zeros(1, 4), torch.zeros(3, 4)), "bfloat16 or float16"),
    ((torch.zeros(1, 4, dtype=torch.float16), torch.zeros(3, 4, dtype=torch.bfloat16)), "x is Half"),
    ((torch.zeros(1, 5, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16)), "the weight's K is 4"),
    ((torch.zeros(1, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16).T), "contiguous"),
    ((torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16),
      torch.zeros(2, dtype=torch.bfloat16)), "bias must be \\[N\\] of the weight"),
])
def test_bad_operands_raise_clear_errors(args, message):
    with pytest.raises(RuntimeError, match=message):
        ops.linear16(*args)


def test_opcheck():
    x, w, b = operands(5, 40, 20, torch.bfloat16, seed=2, bias=True)
    torch.library.opcheck(torch.ops.wcodec.linear16.default, (x, w, b))
    torch.library.opcheck(torch.ops.wcodec.linear16.default, (x[:1], w, None))


SIMD = torch.backends.cpu.get_cpu_capability().startswith("AVX512") and os.environ.get("WCODEC_CPU_SIMD") != "0"
needs_simd = pytest.mark.skipif(not SIMD, reason="linear16_pack needs an AVX-512 CPU")


@needs_simd
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 32, 32), (1, 576, 960), (3, 64, 1536), (12, 1536, 576), (13, 96, 64),
                                   (29, 576, 3072), (0, 64, 32)])
def test_a_packed_weight_gives_linear16_bit_for_bit(shape, bias):
    """linear16_pack once, linear16_packed every call: the same outputs as linear16, bit for bit
    (the same blocks, transposed ahead), specials included; and row blocks of a packed weight are
    the packed row blocks (so joined projections and their row views stay packed)."""
    require_cpu_ops(ops.PACKED_OPS, "linear16_pack")
    rows, k, n = shape
    x, w, b = operands(rows, k, n, torch.bfloat16, seed=k + n, bias=bias)
    if rows:
        x[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    w[1, 5] = float("-inf")
    packed = ops.linear16_pack(w)
    assert packed.shape == w.shape and packed.dtype == w.dtype and not torch.equal(packed, w)
    bits = lambda t: t.view(torch.int16)                            # NaN's bits too
    assert torch.equal(bits(ops.linear16_packed(x, packed, b)), bits(ops.linear16(x, w, b)))
    half = n // 64 * 32
    if half:
        assert torch.equal(bits(ops.linear16_pack(w[half:].contiguous())), bits(packed[half:]))
        assert torch.equal(bits(ops.linear16_packed(x, packed[:half])), bits(ops.linear16(x, w[:half])))


@needs_simd
@pytest.mark.parametrize("shape", [(33, 64), (32, 48), (31, 32)])
def test_pack_refuses_what_it_cannot_pack_in_place(shape):
    require_cpu_ops(ops.PACKED_OPS, "linear16_pack")
    w = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.linear16_pack(w)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.linear16_packed(torch.zeros(1, shape[1], dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.linear16_pack(torch.zeros(64, 64, dtype=torch.float16))


@needs_simd
def test_packed_opcheck():
    require_cpu_ops(ops.PACKED_OPS, "linear16_pack")
    x, w, b = operands(3, 64, 96, torch.bfloat16, seed=5, bias=True)
    torch.library.opcheck(torch.ops.wcodec.linear16_pack.default, (w,))
    torch.library.opcheck(torch.ops.wcodec.linear16_packed.default, (x, ops.linear16_pack(w), b))


def test_callers_on_several_threads_get_the_same_bits():
    """linear16 spreads a call over the caller and the pool's helpers (cuda_ext/csrc/cpu_pool.h);
    callers on other threads at the same time (two engines) each get their own product, bit for
    bit what one caller alone gets."""
    jobs = [operands(rows, 576, 960 + 32 * i, torch.bfloat16, seed=i, bias=i % 2 == 0)
            for i, rows in enumerate((1, 1, 3, 12, 1, 29))]
    alone = [ops.linear16(*job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for _ in range(20):
            together = list(pool.map(lambda job: ops.linear16(*job), jobs))
            assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_a_forked_child_multiplies_without_the_parents_helpers():
    """A child forked after the pool's helpers started has none of them: it multiplies alone."""
    x, w, b = operands(1, 576, 3072, torch.bfloat16, seed=4, bias=False)
    y = ops.linear16(x, w, b)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if torch.equal(ops.linear16(x, w, b), y) else 1)
    assert os.waitpid(pid, 0)[1] == 0
