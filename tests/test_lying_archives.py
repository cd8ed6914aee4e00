"""Archives that lie, through every reader: `codec.decode.load` (NumPy reference), `wcodec.load`
(the pipeline with the C++ twin, plus decoded-tensor CRCs), `wcodec decompress` and the server's
loader (`service.load.pipeline.decode_archive`).

Headers re-written with a valid CRC but lying offsets, lengths, shapes, names, types, nesting and
counts each give a typed CodecError naming the file; random data-region mutations with stream CRCs
off give a typed error or exact bits (tests/faults/archives.py says which reader must do what).
Never an untyped exception, a hang or a memory blow-up. The long form (2 000 mutations) is
`python scripts/reliability.py lies`; its figures are in docs/RELIABILITY.md.
"""
from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

import cuda_ext
from tests.faults.archives import (
    HEADER_LIES,
    RSS_LIMIT,
    TIME_LIMIT,
    base_archive,
    check_mutation,
    lying,
    outcome,
    readers,
)

MUTATIONS = 120                  # CI; the long form runs 2 000
READERS = readers()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory):
    return base_archive(tmp_path_factory.mktemp("lies") / "base.wcodec")


def test_the_twin_is_what_is_tested() -> None:
    """The decoders fall back to the NumPy reference without the C++ twin: these tests need it built."""
    assert cuda_ext.available().cpp, cuda_ext.available().reason


@pytest.mark.parametrize("reader", list(READERS))
def test_the_truthful_archive_reads_exactly(base, tmp_path: Path, reader: str) -> None:
    archive, state = base
    path = tmp_path / "base.wcodec"
    path.write_bytes(archive.data)
    got = outcome(READERS[reader], path, state)
    assert got.kind == "exact", got.detail


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lie", list(HEADER_LIES))
def test_header_lies(base, tmp_path: Path, lie: str) -> None:
    archive, state = base
    path = tmp_path / f"{lie}.wcodec"
    path.write_bytes(lying(archive, HEADER_LIES[lie]))
    for name, read in READERS.items():
        got = outcome(read, path, state)
        assert got.kind == "error", f"{name}: {got.kind} {got.detail}"
        assert got.seconds < TIME_LIMIT and got.peak_rss_growth < RSS_LIMIT, (name, got)


@pytest.mark.timeout(600)
def test_random_data_region_mutations(base, tmp_path: Path) -> None:
    archive, state = base
    rng = random.Random(12)
    kinds: collections.Counter = collections.Counter()
    failures = []
    for i in range(MUTATIONS):
        result = check_mutation(archive, state, rng, tmp_path, READERS)
        kinds.update(f"{name}:{o.kind}" for name, o in result.outcomes.items())
        failures += [f"#{i} {result.edits}: {f}" for f in result.failures]
    assert not failures, failures[:10]
    # the mutations reached the decoders: some were caught by them, not only by CRCs
    assert kinds["reference-nv:error"] > 0 and kinds["reference:error"] > 0, kinds
    print(dict(sorted(kinds.items())))
