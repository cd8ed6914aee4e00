"""kill -9 during `wcodec compress` never leaves a file that a reader accepts (tests/faults/crash.py);
a run that finishes leaves exactly the archive, which loads bit-exact."""
from __future__ import annotations

from pathlib import Path

import pytest

from codec.decode import load
from tests.faults.crash import kill_compress

# where to kill, as a share of the finished archive's size written beside DST: as soon as it exists,
# a quarter, half and nine tenths of the way
KILL_AT = [0.0, 0.25, 0.5, 0.9]


@pytest.mark.timeout(300)
def test_kill_during_compress_leaves_nothing_a_reader_accepts(minilm_dir: Path, tmp_path: Path) -> None:
    src = minilm_dir / "model.safetensors"
    whole = tmp_path / "whole" / "out.wcodec"
    whole.parent.mkdir()
    result = kill_compress(src, whole, None)
    assert result["exit"] == 0 and result["left"] == ["out.wcodec"] and result["accepted"] == ["out.wcodec"], result
    assert result["accepted_partial"] == [], result
    assert len(load(whole, workers=1).state_dict) > 0
    size = whole.stat().st_size
    cut_short = 0
    for i, share in enumerate(KILL_AT):
        dst = tmp_path / f"run{i}" / "out.wcodec"
        dst.parent.mkdir()
        result = kill_compress(src, dst, int(share * size))
        assert result["accepted_partial"] == [], result      # nothing but the complete archive opens
        cut_short += result["killed"] and result["accepted"] == []
    # a kill lands before the rename unless the machine stalls the test for the last share's writing
    assert cut_short >= len(KILL_AT) - 1, "the kills came too late to interrupt a compress"
