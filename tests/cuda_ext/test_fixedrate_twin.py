"""The fixed-rate form's C++ twin against the NumPy reference behind the same op interface: the
encoder's arrays bit for bit, the decode, the matmul reference, opcheck, and the shared constants."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from codec import fixedrate as F
from cuda_ext import fixedrate as fr_ops
from cuda_ext import ops
from tests.cuda_ext.extension import require_cpu_ops
from tests.tensors import make_tensor

SHAPES = [(1, 1), (3, 31), (2, 33), (5, 127), (4, 129), (7, 1000), (3, 1024), (2, 4096 + 160), (0, 64), (40, 2049)]
HEADER = (Path(__file__).parents[2] / "cuda_ext" / "csrc" / "fixedrate.h").read_text()


@pytest.fixture(scope="module", autouse=True)
def twin():
    require_cpu_ops(ops.FIXEDRATE_OPS, "the fixed-rate ops")


def assert_same_arrays(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, g, w in zip(fr_ops.ARRAYS, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.cpu(), w), name


def test_constants_match_codec():
    for name, value in (("kFrGroup", F.GROUP), ("kFrTile", F.TILE), ("kFrBlockGroups", F.BLOCK_GROUPS),
                        ("kFrCodes", F.CODES), ("kFrMaxBase", F.MAX_BASE), ("kFrLoWords", F.LO_WORDS),
                        ("kFrFieldShift", F.FIELD_SHIFT)):
        assert int(re.search(rf"constexpr int {name} = (\d+);", HEADER).group(1)) == value, name
    assert fr_ops.FUSED_MAX_ROWS == 64
    host = (Path(__file__).parents[2] / "cuda_ext" / "csrc" / "fixedrate_host.h").read_text()
    for name, value in (("kFrSlotRows", fr_ops.SLOT_ROWS), ("kFrWideRows", fr_ops.WIDE_ROWS)):
        assert int(re.search(rf"constexpr int {name} = (\d+);", host).group(1)) == value, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bits", "normal", "mixed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_twin_encodes_like_the_reference(dtype, kind, shape):
    w = make_tensor(dtype, shape, seed=sum(shape) + 1, kind=kind)
    got = ops.fixedrate_encode(w)
    assert_same_arrays(got, fr_ops.reference_encode(w))
    out = torch.full_like(w, 7.0)                                   # poisoned: every element must be written
    ops.fixedrate_decode(*got, shape[1], out)
    assert torch.equal(out.view(torch.int16), w.view(torch.int16))


def test_every_16_bit_pattern_through_the_twin():
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).reshape(128, 512)
    for order in (w, w.T.contiguous()):
        bf = order.view(torch.bfloat16)
        arrays = ops.fixedrate_encode(bf)
        assert_same_arrays(arrays, fr_ops.reference_encode(bf))
        assert torch.equal(fr_ops.decode(fr_ops.FixedRateWeight(*bf.shape, bf.dtype, *arrays)).view(torch.int16), order)


def test_twin_matmul_is_the_reference():
    w = fr_ops.sample_weight(torch.bfloat16, 33, 1000, seed=3)
    fr = fr_ops.encode(w)
    for n in (1, 5, 16):
        x = fr_ops.padded_x(n, fr, seed=n)
        got = ops.fixedrate_linear(x, *fr.arrays, fr.cols)
        want = fr_ops.reference_linear(x, *fr.arrays, fr.cols)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_linear_on_cpu_is_decode_then_matmul():
    w = (torch.randn(24, 70, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16()
    fr = fr_ops.encode(w)
    x = torch.randn(3, 2, 70, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(fr_ops.linear(x, fr), torch.nn.functional.linear(x, w))


def test_x_in_the_kernels_layout_on_the_cpu():
    """The fused kernel's x layouts: none under 7 rows or past fused_limit(), one m16 tile (16 rows)
    up to 16, whole n8 tiles from 17; columns in whole tiles, zeros past x's rows and columns. The
    op on x in its layout (the reference puts it back in place) is fixedrate_linear's reference bit
    for bit; a wrong shape or row count raises."""
    assert [fr_ops.permuted_rows(n) for n in (1, 6, 7, 16, 17, 24, 25, 32, 33)] == [0, 0, 16, 16, 24, 24, 32, 32, 0]
    assert [fr_ops.permuted_cols(c) for c in (64, 1000, 4096, 11008)] == [128, 1024, 4096, 11008]
    fr = fr_ops.encode(fr_ops.sample_weight(torch.bfloat16, 40, 1000, seed=3, finite=True))
    with fr_ops.fused_rows(64):
        assert fr_ops.permuted_rows(33) == 40 and fr_ops.permuted_rows(64) == 64
        for n in (7, 12, 16, 17, 40, 64):
            x = fr_ops.padded_x(n, fr, seed=n)
            permuted = fr_ops.permute(x[:, :fr.cols])
            rows = fr_ops.permuted_rows(n)
            assert permuted.data.shape == (rows, 1024) and permuted.shape == (n, 1000)
            assert int((permuted.data != 0).sum()) == int((x != 0).sum())          # x's values, zeros elsewhere
            assert torch.equal(ops.fixedrate_linear_permuted(permuted.data, n, *fr.arrays, fr.cols),
                               ops.fixedrate_linear(x, *fr.arrays, fr.cols))
    with pytest.raises(RuntimeError, match="a permuted x holds 7 to 64 rows"):
        ops.fixedrate_linear_permuted(permuted.data, 6, *fr.arrays, fr.cols)
    with pytest.raises(RuntimeError, match="permuted x: contiguous"):
        ops.fixedrate_linear_permuted(permuted.data[:40], 64, *fr.arrays, fr.cols)
    with pytest.raises(ValueError, match="5 rows take no permuted layout"):
        fr_ops.permute(x[:5, :fr.cols])


def test_fused_rows_raises_the_default_inside_its_block_only():
    """fused_rows(n) lets linear's default fuse up to n rows in its block (the engine's decode-only
    steps), in its thread only; outside the block, and in another thread, FUSED_ROWS."""
    import threading
    assert fr_ops.fused_limit() == fr_ops.FUSED_ROWS == 32
    seen = []
    with fr_ops.fused_rows(64):
        assert fr_ops.fused_limit() == 64
        with fr_ops.fused_rows(40):
            assert fr_ops.fused_limit() == 40
        assert fr_ops.fused_limit() == 64
        t = threading.Thread(target=lambda: seen.append(fr_ops.fused_limit()))
        t.start(), t.join()
    assert fr_ops.fused_limit() == 32 and seen == [32]
    for rows in (31, 65):
        with pytest.raises(ValueError, match=f"fused_rows: {rows} rows, not in 32..64"):
            with fr_ops.fused_rows(rows):
                pass
    assert fr_ops.fused_limit() == 32


def test_bad_arguments_raise():
    fr = fr_ops.encode(fr_ops.sample_weight(torch.bfloat16, 4, 64, seed=6))
    with pytest.raises(RuntimeError):
        ops.fixedrate_decode(*fr.arrays, 200, torch.empty(4, 200, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        ops.fixedrate_decode(fr.plane, fr.lo, fr.hi[:2], fr.tile, fr.esc, fr.esc_start, 64,
                             torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        ops.fixedrate_encode(torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        fr_ops.encode(torch.zeros(2, 2))


def test_opcheck_cpu():
    for name, args in fr_ops.sample_inputs("cpu"):
        torch.library.opcheck(getattr(torch.ops.wcodec, name).default, args)


def test_round_trip_through_codec_objects():
    w = make_tensor(torch.float16, (5, 300), seed=9, kind="mixed")
    fr = fr_ops.encode(w)
    back = fr_ops.FixedRateWeight.from_codec(fr.to_codec())
    assert_same_arrays(list(back.arrays), list(fr.arrays))
    assert np.array_equal(F.decode(fr.to_codec()), w.view(torch.int16).numpy().view(np.uint16))


def test_cat_rows_and_row_views_decode_to_the_parts():
    parts = [fr_ops.sample_weight(torch.bfloat16, rows, 1000, seed=10 + rows, finite=True) for rows in (7, 1, 33)]
    joined = fr_ops.cat_rows([fr_ops.encode(w) for w in parts])
    assert joined.esc.numel() > 0 and torch.equal(fr_ops.decode(joined).view(torch.int16), torch.cat(parts).view(torch.int16))
    for view, w in zip(fr_ops.row_views(joined, [7, 1, 33]), parts):
        assert view.plane.untyped_storage().data_ptr() == joined.plane.untyped_storage().data_ptr()   # no copy
        assert torch.equal(fr_ops.decode(view).view(torch.int16), w.view(torch.int16))
        x = fr_ops.padded_x(3, view, seed=1)
        assert torch.equal(ops.fixedrate_linear(x, *view.arrays, view.cols), fr_ops.reference_linear(x, *view.arrays, view.cols))


def test_cat_rows_refuses_other_shapes():
    a, b = (fr_ops.encode(fr_ops.sample_weight(torch.bfloat16, 2, cols, seed=cols)) for cols in (64, 96))
    with pytest.raises(ValueError):
        fr_ops.cat_rows([a, b])
