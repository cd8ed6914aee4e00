"""Round trips through the whole codec: state dict -> `.wcodec` -> state dict, bit for bit.

Float tensors are generated as BIT PATTERNS (integer arrays viewed as the float dtype), so NaN
payloads, +-Inf, -0 and denormals all occur; realistic weights come from normal distributions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from codec import decode, encode
from codec.constants import CODEC_FLOAT, CODEC_RAW, MIN_CODED_ELEMENTS, SEGMENT_SYMBOLS
from codec.decode import Archive, load
from codec.encode import compress, compress_state_dict
from tests.tensors import make_tensor

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
RAW_DTYPES = [torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
ALL_DTYPES = FLOAT_DTYPES + RAW_DTYPES

# Peer to beat (shared/PEERS.md, ZipNN section): real MiniLM-L6 weights cast to bf16 compress to
# a ratio of 0.6648 with ZipNN.
ZIPNN_MINILM_BF16_RATIO = 0.6648


SHAPES = [(), (0,), (0, 5), (5, 0, 3), (1,), (1, 1), (7,), (3, 5), (13, 17), (MIN_CODED_ELEMENTS - 1,),
          (MIN_CODED_ELEMENTS,), (MIN_CODED_ELEMENTS + 1,), (64, 64), (4097, 1), (3, 1999), (9001,)]


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(st.one_of(st.sampled_from(SHAPES),
                           st.lists(st.integers(0, 90), min_size=1, max_size=3).map(tuple)))
    kind = draw(st.sampled_from(["bits", "normal", "mixed"]))
    return make_tensor(dtype, shape, draw(st.integers(0, 2**32 - 1)), kind)


def _anchor() -> torch.Tensor:
    """A tensor the float codec always codes: keeps every encode batch non-empty for the float
    path, so the tests below probe what they name (see test_only_raw_tensors for that case)."""
    return make_tensor(torch.bfloat16, (MIN_CODED_ELEMENTS,), 0, "normal")


@settings(max_examples=80)
@given(st.lists(tensors(), min_size=1, max_size=3))
def test_random_tensors_round_trip(roundtrip, bit_exact, ts: list[torch.Tensor]) -> None:
    state = {f"t{i}": t for i, t in enumerate(ts)} | {"anchor": _anchor()}
    _, model = roundtrip(state)
    bit_exact(state, model.state_dict)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_edge_shapes_every_dtype(roundtrip, bit_exact, dtype: torch.dtype) -> None:
    state = {f"s{i}": make_tensor(dtype, shape, i, "mixed") for i, shape in enumerate(SHAPES)}
    state["anchor"] = _anchor()
    path, model = roundtrip(state)
    bit_exact(state, model.state_dict)
    with Archive.open(path) as archive:
        for e in archive.entries:
            if e.name != "anchor" and (dtype not in FLOAT_DTYPES or e.numel < MIN_CODED_ELEMENTS):
                assert e.codec == CODEC_RAW, e.name


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "mixed", "bits"])
def test_float_codec_around_min_coded_elements(roundtrip, bit_exact, dtype: torch.dtype, kind: str) -> None:
    sizes = [MIN_CODED_ELEMENTS - 1, MIN_CODED_ELEMENTS, MIN_CODED_ELEMENTS + 1, 3 * MIN_CODED_ELEMENTS + 5]
    state = {f"n{n}": make_tensor(dtype, (n,), n, kind) for n in sizes} | {"anchor": _anchor()}
    path, model = roundtrip(state)
    bit_exact(state, model.state_dict)
    codecs = {e.name: e.codec for e in Archive.open(path).entries}
    assert codecs[f"n{MIN_CODED_ELEMENTS - 1}"] == CODEC_RAW
    if kind == "normal":                                   # weights compress: the float codec runs
        assert all(codecs[f"n{n}"] == CODEC_FLOAT for n in sizes[1:])


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_constant_tensor_one_frequency(roundtrip, bit_exact, dtype: torch.dtype, value: float) -> None:
    """One exponent value: its table is a single frequency of M, so the rANS emits no words."""
    value = float("nan") if dtype == torch.float8_e4m3fn and value == float("inf") else value   # no inf
    state = {"c": torch.full((3 * MIN_CODED_ELEMENTS,), value, dtype=dtype)}
    path, model = roundtrip(state)
    bit_exact(state, model.state_dict)
    entry = Archive.open(path).entries[0]
    assert entry.codec == CODEC_FLOAT
    assert entry.streams["exp"]["length"] < 1024


def test_segment_boundaries(roundtrip, bit_exact) -> None:
    """Tensors one symbol short of, exactly, one past, and two segments plus a partial step past
    a segment, for each float dtype, encoded in one batch."""
    state = {}
    for dtype in FLOAT_DTYPES:
        for n in (SEGMENT_SYMBOLS - 1, SEGMENT_SYMBOLS, SEGMENT_SYMBOLS + 1, 2 * SEGMENT_SYMBOLS + 33):
            state[f"{str(dtype)[6:]}.{n}"] = make_tensor(dtype, (n,), n, "mixed")
    path, model = roundtrip(state)
    bit_exact(state, model.state_dict)
    for e in Archive.open(path).entries:
        assert e.codec == CODEC_FLOAT and e.params.n_segments == -(-e.numel // SEGMENT_SYMBOLS)


def test_segments_with_different_statistics_use_several_tables(roundtrip, bit_exact) -> None:
    """Every 4 segments (the smallest table group) have their own scale, so per-group table sets
    pay off; the decoder must pick each segment's set (and each element's context table)."""
    gen = torch.Generator().manual_seed(7)
    scales = torch.tensor([1e-4, 1e4, 3e-2]).repeat_interleave(4 * SEGMENT_SYMBOLS)[:8 * SEGMENT_SYMBOLS + 100]
    state = {"w": (torch.randn(len(scales), generator=gen) * scales).to(torch.bfloat16).reshape(-1, 4)}
    path, model = roundtrip(state)
    bit_exact(state, model.state_dict)
    params = Archive.open(path).entries[0].params
    assert params.n_tables > 1 and params.table_group < params.n_segments


ONLY_RAW = {
    "small-ints": ({"a": torch.arange(3, dtype=torch.int8), "b": torch.ones(2, 2, dtype=torch.bool)}, 1),
    "small-floats": ({"w": torch.randn(10, generator=torch.Generator().manual_seed(0))}, 1),
    "random-bits": ({"w": make_tensor(torch.bfloat16, (3 * MIN_CODED_ELEMENTS,), 5, "bits")}, 1),
    "0-d": ({"s": torch.tensor(2.5, dtype=torch.bfloat16)}, 1),
    # a real checkpoint: with 2 workers the jobs split so that one job holds only the int8 tensor
    "one-raw-job": ({"w": make_tensor(torch.bfloat16, (8192,), 1, "normal"),
                     "q": torch.zeros(8192, dtype=torch.int8)}, 2),
}


@pytest.mark.parametrize("state,workers", list(ONLY_RAW.values()), ids=list(ONLY_RAW))
def test_only_raw_tensors(roundtrip, bit_exact, state: dict[str, torch.Tensor], workers: int) -> None:
    """An encode batch in which no tensor is float-coded (all stored raw)."""
    _, model = roundtrip(state, workers=workers)
    bit_exact(state, model.state_dict)


def test_non_contiguous_and_empty_inputs(roundtrip, bit_exact) -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(96, 80, generator=gen).to(torch.bfloat16)
    state = {"t": base.t(), "slice": base[::2, 1::3], "empty": torch.empty(0, 3, dtype=torch.float32)}
    _, model = roundtrip(state)
    bit_exact({k: v.contiguous() for k, v in state.items()}, model.state_dict)


def test_empty_state_dict(roundtrip) -> None:
    path, model = roundtrip({}, files={"config.json": b"{}"})
    assert model.state_dict == {} and model.files == {"config.json": b"{}"} and model.config == {}
    assert Archive.open(path).entries == []


def test_embedded_files_round_trip_byte_exact(roundtrip, bit_exact) -> None:
    rng = np.random.default_rng(11)
    files = {
        "config.json": b'{"model_type": "llama", "hidden_size": 8}',
        "tokenizer.json": rng.integers(0, 256, 100_003, dtype=np.uint8).tobytes(),
        "empty.txt": b"",
        "caf\u00e9 \u00fcnicode.bin": bytes(range(256)) * 3,
    }
    state = {"w": make_tensor(torch.bfloat16, (5000,), 1, "normal")}
    _, model = roundtrip(state, files=files)
    assert model.files == files
    assert model.config == {"model_type": "llama", "hidden_size": 8}
    bit_exact(state, model.state_dict)


def test_tensors_are_stored_in_layer_order(roundtrip) -> None:
    names = ["model.layers.10.x", "model.layers.1.x", "lm_head.weight", "model.embed_tokens.weight",
             "model.layers.0.x", "model.norm.weight", "model.layers.2.x"]
    state = {n: make_tensor(torch.bfloat16, (MIN_CODED_ELEMENTS,), i, "normal") for i, n in enumerate(names)}
    path, _ = roundtrip(state)
    with Archive.open(path) as archive:
        assert [e.name for e in archive.entries] == [
            "model.embed_tokens.weight", "model.layers.0.x", "model.layers.1.x", "model.layers.2.x",
            "model.layers.10.x", "model.norm.weight", "lm_head.weight"]
        assert [e.layer for e in archive.entries] == [None, 0, 1, 2, 10, None, None]


def _multi_tensor_state() -> dict[str, torch.Tensor]:
    state = {}
    for i in range(6):
        state[f"model.layers.{i}.mlp.weight"] = make_tensor(torch.bfloat16, (256, 1024 + i), i, "normal")
        state[f"model.layers.{i}.attn.weight"] = make_tensor(torch.float32, (128, 300 + i), 100 + i, "mixed")
        state[f"model.layers.{i}.norm.weight"] = make_tensor(torch.float16, (1024,), 200 + i, "normal")
    state["model.embed_tokens.weight"] = make_tensor(torch.bfloat16, (SEGMENT_SYMBOLS + 77,), 9, "mixed")
    state["model.ids"] = make_tensor(torch.int64, (4321,), 10, "bits")
    return state


def test_parallel_and_batching_are_deterministic(tmp_path: Path, monkeypatch, bit_exact) -> None:
    """The file's bytes depend only on the tensors: not on workers, nor on how tensors are
    batched together for the vectorised encoder (several MB, many jobs in flight)."""
    state = _multi_tensor_state()
    assert sum(t.nbytes for t in state.values()) > 4 << 20
    compress_state_dict(state, tmp_path / "one.wcodec", workers=1)
    monkeypatch.setattr(encode, "BATCH_ELEMENTS", 300_000)
    compress_state_dict(state, tmp_path / "two.wcodec", workers=2)
    compress_state_dict(state, tmp_path / "one_small.wcodec", workers=1)
    reference = (tmp_path / "one.wcodec").read_bytes()
    assert (tmp_path / "two.wcodec").read_bytes() == reference
    assert (tmp_path / "one_small.wcodec").read_bytes() == reference
    monkeypatch.setattr(decode, "BATCH_ELEMENTS", 200_000)
    bit_exact(state, load(tmp_path / "two.wcodec", workers=2).state_dict)
    bit_exact(state, load(tmp_path / "two.wcodec", workers=1, verify=False).state_dict)


_FORK_AFTER_TORCH = """
import sys, torch
from codec.encode import compress_state_dict
x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
(x * 2).sum()                                       # the parent runs an intra-op parallel region
state = {f"model.layers.{i}.w": x[i * 512:(i + 1) * 512, ::2] for i in range(4)}   # non-contiguous
compress_state_dict(state, sys.argv[1], workers=2)  # forked workers copy them with torch
"""


def test_parallel_compress_after_torch_work_does_not_hang(tmp_path: Path) -> None:
    """Workers are forked from a process whose OpenMP pool is live; a torch op in a worker (here
    the .contiguous() copy of a non-contiguous tensor) must not deadlock. Run in a child process
    group so a deadlock fails the test instead of hanging the suite."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _FORK_AFTER_TORCH, str(tmp_path / "x.wcodec")],
                            cwd=root, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)                 # the child and its forked workers
        proc.communicate()
        pytest.fail("compress_state_dict(workers=2) deadlocked in a forked worker (libgomp after fork)")
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]


# --- real weights ------------------------------------------------------------------------------


def test_minilm_folder_round_trip(tmp_path: Path, minilm_dir: Path, bit_exact) -> None:
    dst = tmp_path / "minilm.wcodec"
    stats = compress(minilm_dir, dst, workers=2)
    reference = load_file(minilm_dir / "model.safetensors")
    model = load(dst, workers=2)
    bit_exact(reference, model.state_dict)
    assert {"config.json", "tokenizer.json"} <= set(model.files)
    for name in ("config.json", "tokenizer.json"):
        assert model.files[name] == (minilm_dir / name).read_bytes()
    assert model.config == load(dst, workers=1).config
    assert stats.file_bytes == os.path.getsize(dst) and stats.tensors == len(reference)
    assert stats.ratio < 0.9                                   # fp32: only the exponent byte shrinks


def test_minilm_bf16_beats_zipnn(tmp_path: Path, minilm_dir: Path, bit_exact) -> None:
    reference = load_file(minilm_dir / "model.safetensors")
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in reference.items()}
    dst = tmp_path / "minilm_bf16.wcodec"
    compress_state_dict(state, dst, workers=2)
    bit_exact(state, load(dst, workers=2).state_dict)
    ratio = os.path.getsize(dst) / sum(t.nbytes for t in state.values())
    assert ratio < ZIPNN_MINILM_BF16_RATIO, ratio          # shared/PEERS.md: ZipNN's 0.6648


def test_stage_times_are_printed_when_asked(tmp_path, monkeypatch, capsys):
    """WCODEC_TIMINGS=1: compress names the seconds of its stages on stderr (codec/stagetimes.py)."""
    state = {"w": make_tensor(torch.bfloat16, (300, 200), 3, "normal")}
    compress_state_dict(state, tmp_path / "quiet.wcodec")
    assert "compress stages" not in capsys.readouterr().err
    monkeypatch.setenv("WCODEC_TIMINGS", "1")
    compress_state_dict(state, tmp_path / "timed.wcodec")
    err = capsys.readouterr().err
    stages, parts = err.strip().splitlines()[-2:]
    assert stages.startswith("compress stages (s): ") and " wait for write " in stages and ", finish " in stages
    assert "/" not in stages and "checksums" not in stages           # the parts have their own line
    assert parts.startswith("compress write parts (s): checksums ") and ", file " in parts
    assert (tmp_path / "quiet.wcodec").read_bytes() == (tmp_path / "timed.wcodec").read_bytes()
