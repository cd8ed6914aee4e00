"""kill -9 during `wcodec compress` never leaves a file that a reader accepts (tests/faults/crash.py);
a run that finishes leaves exactly the archive, which loads bit-exact."""
from __future__ import annotations

from pathlib import Path

import pytest

from codec.decode import load
from tests.faults.crash import kill_compress

KILL_AFTER_S = [0.5, 2.0, 4.0, 6.0, 8.0]


@pytest.mark.timeout(300)
def test_kill_during_compress_leaves_nothing_a_reader_accepts(minilm_dir: Path, tmp_path: Path) -> None:
    src = minilm_dir / "model.safetensors"
    killed = 0
    for i, after in enumerate(KILL_AFTER_S):
        dst = tmp_path / f"run{i}" / "out.wcodec"
        dst.parent.mkdir()
        result = kill_compress(src, dst, after)
        assert result["accepted_partial"] == [], result
        if result["finished"]:
            assert result["left"] == ["out.wcodec"] and result["accepted"] == ["out.wcodec"], result
            assert len(load(dst, workers=1).state_dict) > 0
        else:
            killed += 1
    assert killed >= 2, "the kills came too late to interrupt a compress"
