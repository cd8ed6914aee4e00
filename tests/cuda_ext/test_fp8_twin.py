"""The W8A16 op's C++ twin (cuda_ext/csrc/fp8_linear.cpp): the e4m3 -> bf16 steps bit for bit
against torch's cast, the product against a float64 reference for every kind of scale grid, its
caller checks, and opcheck."""
from __future__ import annotations

import pytest
import torch

from cuda_ext import fp8
from tests.cuda_ext.extension import require_cpu_ops


@pytest.fixture(scope="module", autouse=True)
def twin():
    require_cpu_ops(fp8.FP8_OPS, "the fp8 ops")


def test_every_byte_decodes_as_torchs_cast_but_nan():
    w = torch.arange(256, dtype=torch.uint8)
    got, want = fp8.to_bf16(w).view(torch.int16), w.view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16)
    differ = (got != want).nonzero().flatten().tolist()
    assert differ == list(fp8.NAN_BYTES)
    assert torch.equal(got[0x80], torch.tensor(-32768, dtype=torch.int16))        # -0 keeps its sign
    assert fp8.to_bf16(w[1:4].reshape(3)).shape == (3,)                            # any length, a copy


# (N, K, block): a scale per row, per tensor, per 128 x 128 block (ragged both ways), per 16 x 128
GRIDS = [(40, 336, (1, 336)), (130, 272, (130, 272)), (300, 400, (128, 128)), (48, 256, (16, 128))]


@pytest.mark.parametrize(("n", "k", "block"), GRIDS)
@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_the_product_is_the_checkpoints_within_bf16s_rounding(n, k, block, m):
    g = torch.Generator().manual_seed(n + m)
    w = fp8.sample_weight(n, k, seed=n)
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=g) / 64 + 1e-3
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = fp8.linear(x, w, scale, block)
    want = fp8.reference(x, w, scale, block)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = (got.double() - want).abs()
    assert bool((err <= want.abs() * 2.0 ** -8 + 1e-6 * want.abs().max()).all()), err.max()   # one rounding


@pytest.mark.parametrize(("n", "k", "block"), GRIDS + [(64, 96, (32, 48))])
def test_dequantize_is_decoded_modes_weights_bit_for_bit(n, k, block):
    from service.model import fp8 as served
    w = fp8.sample_weight(n, k, seed=n)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=torch.Generator().manual_seed(n)) / 64
    want = served.dequantized_grid(w.view(torch.float8_e4m3fn), scale, block, torch.bfloat16)
    assert torch.equal(fp8.dequantize(w, scale, block).view(torch.int16), want.view(torch.int16))


def test_block_scales_multiply_their_own_columns():
    """A grid whose blocks differ: each block's sum times its own scale (a mix-up of blocks, rows
    or columns gives another product)."""
    w = fp8.sample_weight(32, 256, seed=3)
    x = torch.randn(2, 256).to(torch.bfloat16)
    scale = torch.tensor([[1.0, 0.0]])                       # the second block's columns count for nothing
    got = fp8.linear(x, w, scale, (32, 128))
    first = fp8.linear(x[:, :128].contiguous(), w[:, :128].contiguous(), torch.ones(1, 1), (32, 128))
    assert torch.equal(got, first)


@pytest.mark.parametrize(("bad", "match"), [
    (lambda x, w, s: (x, w, torch.ones(3, 1), (1, 64)), "does not cut W"),
    (lambda x, w, s: (x, w, torch.ones(2, 2), (16, 32)), "blocks of 32 columns"),
    (lambda x, w, s: (x.float(), w, s, (1, 64)), "bfloat16"),
    (lambda x, w, s: (x, w.view(torch.int8), s, (1, 64)), "uint8"),
    (lambda x, w, s: (x[:, :32], w, s, (1, 64)), r"x \[M, K\] and W \[N, K\]"),
    (lambda x, w, s: (x, w, s.double(), (1, 64)), "float32 grid"),
])
def test_a_callers_mistake_is_a_clear_error(bad, match):
    x, w, s = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.uint8), torch.ones(32, 1)
    with pytest.raises(RuntimeError, match=match):
        fp8.linear(*bad(x, w, s))


def test_opcheck_cpu():
    for name, args in fp8.sample_inputs("cpu"):
        torch.library.opcheck(getattr(torch.ops.wcodec, name).default, args)
