"""fp8 weights kept as their e4m3 bytes (service/model/fp8_linear.py): which weights the W8A16 op
takes, the pipeline step that keeps them, and Fp8Linear's product and joins (on the CPU: the
dequantized path, decoded mode's weights bit for bit)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuda_ext import fp8 as fp8_ops
from service.model import fp8, fp8_linear

BF16 = fp8.Scheme("compressed-tensors", torch.bfloat16)
BLOCKS = fp8.Scheme("fp8", torch.bfloat16, (128, 128))


@pytest.mark.parametrize(("name", "shape", "dtype", "grid", "s", "want"), [
    ("a.q_proj.weight", (64, 256), torch.float8_e4m3fn, (1,), BF16, (64, 256)),          # a tensor's scale
    ("a.q_proj.weight", (64, 256), torch.float8_e4m3fn, (64, 1), BF16, (1, 256)),        # a row's
    ("a.q_proj.weight", (64, 256), torch.float8_e4m3fn, (64,), BF16, (1, 256)),
    ("a.q_proj.weight", (300, 400), torch.float8_e4m3fn, (3, 4), BLOCKS, (128, 128)),    # ragged blocks
    ("a.q_proj.weight", (64, 96), torch.float8_e4m3fn, (2, 2), fp8.Scheme("fp8", torch.bfloat16, (32, 48)), None),
    ("a.q_proj.weight", (64, 40), torch.float8_e4m3fn, (64, 1), BF16, None),              # K not a multiple of 16
    ("a.q_proj.weight", (64, 256), torch.float8_e5m2, (64, 1), BF16, None),
    ("a.q_proj.weight", (64, 256), torch.float8_e4m3fn, (64, 1), fp8.Scheme("fbgemm_fp8", torch.float16), None),
    ("model.embed_tokens.weight", (64, 256), torch.float8_e4m3fn, (64, 1), BF16, None),
    ("a.q_proj.weight", (64, 256), torch.float8_e4m3fn, (3, 3), BF16, None),              # no blocks cut it so
])
def test_which_weights_the_op_takes(name, shape, dtype, grid, s, want):
    assert fp8_linear.block_of(name, shape, dtype, grid, s) == want


def _layer(rows=64, cols=256, seed=0, block=(1, 256)):
    w = fp8_ops.sample_weight(rows, cols, seed)
    scale = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=torch.Generator().manual_seed(seed)) / 64
    return w, scale


def test_the_pipeline_keeps_what_the_op_takes_and_dequantizes_the_rest():
    w, scale = _layer()
    nan = w.clone()
    nan[3, 5] = 0x7F                                          # e4m3fn's NaN: the op would read 480
    batch = {"l.q_proj.weight": w.view(torch.float8_e4m3fn), "l.q_proj.weight_scale": scale.view(64, 1),
             "l.k_proj.weight": nan.view(torch.float8_e4m3fn), "l.k_proj.weight_scale": scale.view(64, 1),
             "l.k_proj.input_scale": torch.ones(1), "l.norm.weight": torch.ones(256, dtype=torch.bfloat16)}
    kept = {}
    out = fp8.dequantizing(fp8_linear.keeping(lambda *a: dict(batch), BF16, kept), BF16)()
    assert list(kept) == ["l.q_proj.weight"]
    assert torch.equal(kept["l.q_proj.weight"].weight8, w) and kept["l.q_proj.weight"].block == (1, 256)
    assert kept["l.q_proj.weight"].scale.dtype == torch.float32 and kept["l.q_proj.weight"].nbytes == 64 * 256 + 64 * 4
    assert sorted(out) == ["l.k_proj.weight", "l.norm.weight"] and out["l.k_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("block", [(64, 256), (1, 256), (16, 128)])
def test_an_fp8_linear_on_the_cpu_is_decoded_modes_linear(block):
    w, scale = _layer(block=block)
    linear = fp8_linear.Fp8Linear(fp8_linear.Fp8Weight(w, scale, block), None)
    x = torch.randn(3, 5, 256).to(torch.bfloat16)
    meant = fp8.dequantized_grid(w.view(torch.float8_e4m3fn), scale, block, torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, meant))
    assert linear(x).shape == (3, 5, 64)


@pytest.mark.parametrize("blocks", [[(64, 256), (1, 256), (32, 256)], [(16, 128)] * 3])
def test_joined_fp8_linears_give_each_parts_output(blocks):
    parts = []
    for i, block in enumerate(blocks):
        w, scale = _layer(rows=32 * (i + 1), seed=i, block=block)
        parts.append(fp8_linear.Fp8Linear(fp8_linear.Fp8Weight(w, scale, block), None))
    x = torch.randn(4, 256).to(torch.bfloat16)
    alone = [p(x) for p in parts]
    parent = torch.nn.Module()
    fp8_linear.Fp8Linear.join(parent, "qkv", tuple(parts))
    joined = parent.qkv_linear(x).split([p.out_features for p in parts], -1)
    assert all(torch.equal(a, b) for a, b in zip(alone, joined))
    assert all(torch.equal(p(x), a) for p, a in zip(parts, alone))               # the parts, now views
    assert parts[1].weight8.untyped_storage().data_ptr() == parent.qkv_linear.weight8.untyped_storage().data_ptr()


def test_block_grids_of_other_blocks_are_not_joined():
    parts = [fp8_linear.Fp8Linear(fp8_linear.Fp8Weight(*_layer(rows=48, block=(16, 128)), (16, 128)), None),
             fp8_linear.Fp8Linear(fp8_linear.Fp8Weight(*_layer(rows=64, block=(32, 128)), (32, 128)), None)]
    parent = torch.nn.Module()
    fp8_linear.Fp8Linear.join(parent, "qkv", tuple(parts))
    assert not hasattr(parent, "qkv_linear")


def test_the_fixed_form_leaves_an_fp8_checkpoints_row_scales_to_its_weights(tmp_path):
    """A per-channel scale of 4096 rows is a float-coded bf16 [4096, 1] matrix: the fixed-rate form
    took it away from its weight, and the load failed ("has no 'weight_scale' tensor beside it")."""
    import json

    from codec.encode import compress_state_dict
    from service.load import pipeline

    w = fp8_ops.sample_weight(4096, 64, seed=1).view(torch.float8_e4m3fn)
    scale = (torch.rand(4096, 1) / 64).to(torch.bfloat16)
    state = {"model.layers.0.mlp.up_proj.weight": w, "model.layers.0.mlp.up_proj.weight_scale": scale,
             "model.layers.0.mlp.down_proj.weight": (torch.randn(64, 4096) / 50).to(torch.bfloat16)}
    config = {"quantization_config": {"quant_method": "fbgemm_fp8"}, "torch_dtype": "bfloat16"}
    compress_state_dict(state, tmp_path / "m.wcodec", files={"config.json": json.dumps(config).encode()}, workers=1)
    from codec.decode import Archive
    with Archive.open(tmp_path / "m.wcodec") as archive:
        entries, files = archive.entries, archive.reader.files(True)
    s = fp8.scheme_of(entries, files)
    got = pipeline.decode_archive(tmp_path / "m.wcodec", torch.device("cpu"), compressed=True, form="fixed", fp8_scheme=s)
    assert list(got.fixed) == ["model.layers.0.mlp.down_proj.weight"]
    want = fp8.dequantized_grid(w, scale.float(), (1, 64), torch.bfloat16)
    assert torch.equal(got.tensors["model.layers.0.mlp.up_proj.weight"], want)


def test_an_fp8_models_first_kernels_warm_its_served_dtype():
    from types import SimpleNamespace

    from service.load.early_load import _dtype
    entries = [SimpleNamespace(torch_dtype=torch.float8_e4m3fn, nbytes=1000), SimpleNamespace(torch_dtype=torch.bfloat16, nbytes=10)]
    assert _dtype(entries) == torch.bfloat16
