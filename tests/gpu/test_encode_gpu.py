"""The CUDA encoder twin against the C++ twin (itself held to the NumPy reference by
tests/cuda_ext/test_encode_twin.py): the same op outputs, byte-identical archives (SHA-256) on the
edge cases, a trained-like 8B layer, the carried demo / MiniLM files, and a plane of more than
2^31 elements. WCODEC_ENCODER_ONLY=1 builds just the encoder (scripts/gpu/encoder_ext.py)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

if torch.cuda.is_available() and os.environ.get("WCODEC_ENCODER_ONLY") == "1":
    from scripts.gpu.encoder_ext import load_encoder
    load_encoder()

from codec.constants import SEGMENT_SYMBOLS  # noqa: E402
from codec.encode import compress, compress_state_dict  # noqa: E402
from cuda_ext import encode as ext_encode  # noqa: E402
from cuda_ext import ops  # noqa: E402
from tests.cuda_ext.test_encode_twin import FLOATS, SIZES, batch_planes, edge_tensor  # noqa: E402


def shas(tmp_path, write) -> dict[str, str]:
    out = {}
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.wcodec"
        write(path, ext_encode.coder(device))
        out[device] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_ops_equal_the_cpp_twin():
    prepared, encode = ops.sample_encode_inputs("cuda")
    for data, code in prepared:
        got, want = ops.prepare_plane(data, code), ops.prepare_plane(data.cpu(), code)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), code
    got = ops.encode_planes(*encode)
    want = ops.encode_planes([d.cpu() for d in encode[0]], encode[1], [f.cpu() for f in encode[2]], *encode[3:])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


def test_prepare_planes_equals_the_cpp_twin():
    """The batched op on the GPU (one count launch, one wait) against the C++ twin, plane for plane,
    then its planes encoded in one call: the same streams."""
    data, dtypes = batch_planes("cuda")
    got, want = ops.prepare_planes(data, dtypes), ops.prepare_planes([d.cpu() for d in data], dtypes)
    assert len(got) == len(want) and all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    coded = [i for i, row in enumerate(want[0].tolist()) if row[0]]
    args = [[dtypes[i] for i in coded], [want[0][i, 1].item() for i in coded], [want[0][i, 2].item() for i in coded]]
    streams = ops.encode_planes([data[i] for i in coded], args[0], [got[1 + 3 * i] for i in coded], *args[1:])
    expect = ops.encode_planes([data[i].cpu() for i in coded], args[0], [want[1 + 3 * i] for i in coded], *args[1:])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(streams, expect))


@pytest.mark.parametrize("kind", ["bits", "normal", "mixed"])
def test_edge_cases_identical(tmp_path, kind):
    state = {f"t.{d}.{s}": edge_tensor(dtype, n, 100 * d + s, kind)
             for d, dtype in enumerate(FLOATS) for s, n in enumerate(SIZES)}
    state["constant"] = torch.full((3 * SEGMENT_SYMBOLS,), 0.5, dtype=torch.bfloat16)
    got = shas(tmp_path, lambda p, c: compress_state_dict(state, p, coder=c))
    assert got["cpu"] == got["cuda"]


def test_trained_like_8b_layer_identical(tmp_path):
    import sys
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from fine_decode import LAYER_8B
    from gpu_bench import weights
    layer = weights(LAYER_8B, 1)
    got = shas(tmp_path, lambda p, c: compress_state_dict(layer, p, coder=c))
    assert got["cpu"] == got["cuda"], got
    print("8B layer sha256", got["cuda"][:16])


@pytest.mark.parametrize("name", ["demo.gguf", "minilm"])
@pytest.mark.parametrize("keep", [True, False])
def test_carried_models_identical(tmp_path, name, keep):
    root = Path(os.environ.get("WCODEC_ENCODE_FILES", ".encfiles"))
    src = root / name
    if not src.exists() or (name == "minilm" and not keep):
        pytest.skip(f"{src} not carried")
    got = shas(tmp_path, lambda p, c: compress(src, p, gguf_keep=keep, coder=c))
    assert got["cpu"] == got["cuda"], got
    print(name, "blocks" if keep else "dense", "sha256", got["cuda"][:16])


def test_plane_over_2_31_elements():
    n = (1 << 31) + 4099
    g = torch.Generator(device="cuda").manual_seed(7)
    data = (torch.randn(n, generator=g, device="cuda") * 0.02).bfloat16().view(torch.uint8)
    got = ops.prepare_plane(data, 0)
    host = data.cpu()
    want = ops.prepare_plane(host, 0)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    coded, ctx, group = want[0].tolist()
    assert coded
    stream = ops.encode_planes([data], [0], [got[1]], [ctx], [group])[0]
    assert torch.equal(stream.cpu(), ops.encode_planes([host], [0], [want[1]], [ctx], [group])[0])
