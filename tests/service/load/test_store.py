"""The store: names are plain file stems and cannot point outside it."""
from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import InvalidModelName
from service.load.store import ModelStore, check_name


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "a", "Llama-3.1_8B.v2", "x" * 128])
def test_good_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "a..b", "a b", "a\x00b",
                                  "/etc/passwd", "x" * 129, "é"])
def test_bad_names(name: str) -> None:
    with pytest.raises(InvalidModelName):
        check_name(name)


def test_scan_lists_model_files_only(tmp_path: Path, demo_archive: Path) -> None:
    (tmp_path / "m.wcodec").symlink_to(demo_archive)
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / ".hidden.wcodec").write_bytes(b"")
    (tmp_path / "broken.wcodec").write_bytes(b"not an archive")
    found = ModelStore(tmp_path).scan()
    assert sorted(found) == ["broken", "m"]
    assert found["m"].decoded_bytes == 269030016 and 0.3 < found["m"].ratio < 0.37 and found["m"].error is None
    assert found["broken"].error and "magic" in found["broken"].error
    assert ModelStore(tmp_path).find("nope") is None
