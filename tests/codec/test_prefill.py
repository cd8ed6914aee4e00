"""codec/container.Prefill: the archive file's pages written (zeros) ahead of its Writer, which
writes over them; the archive's bytes are the same as without it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codec import container
from codec.encode import compress_source
from codec.sources import StateDictSource
from tests.tensors import make_tensor


def state() -> dict[str, torch.Tensor]:
    return {"a": make_tensor(torch.bfloat16, (300, 200), 1, "normal"), "b": make_tensor(torch.float32, (77,), 2, "normal")}


def compressed(dst: Path, prefill: container.Prefill | None) -> bytes:
    with StateDictSource(state(), {"config.json": b"{}"}) as source:
        compress_source(source, dst, prefill=prefill)
    return dst.read_bytes()


@pytest.mark.parametrize("nbytes", [0, 1000, 5 << 20])          # shorter than the archive, longer
def test_an_archive_over_a_prefill_is_the_same_bytes(tmp_path: Path, nbytes: int) -> None:
    want = compressed(tmp_path / "plain.wcodec", None)
    prefill = container.Prefill(tmp_path / "filled.wcodec", nbytes)
    assert compressed(tmp_path / "filled.wcodec", prefill) == want
    assert prefill.filled <= nbytes and not list(tmp_path.glob("*.tmp"))
    prefill.discard()                                           # taken: the archive stays
    assert (tmp_path / "filled.wcodec").read_bytes() == want


def test_a_finished_prefill_is_the_zeros_asked_for(tmp_path: Path) -> None:
    prefill = container.Prefill(tmp_path / "z.wcodec", 3 * container.PREFILL_CHUNK // 2)
    prefill._thread.join()
    assert prefill.filled == prefill.nbytes and Path(prefill.tmp).stat().st_size == prefill.nbytes
    assert "0.10 GB of 0.10 GB" in prefill.report()
    prefill.discard()
    assert not Path(prefill.tmp).exists()


def test_a_discarded_prefill_leaves_nothing(tmp_path: Path) -> None:
    prefill = container.Prefill(tmp_path / "gone.wcodec", 1 << 30)
    prefill.discard()
    prefill.discard()
    assert list(tmp_path.iterdir()) == []


def test_a_prefill_that_cannot_make_its_file_leaves_the_error_to_the_writer(tmp_path: Path) -> None:
    dst = tmp_path / "no" / "such" / "folder.wcodec"
    prefill = container.Prefill(dst, 1 << 20)
    with pytest.raises(container.errors.CodecError, match="cannot create"):
        container.Writer(dst, prefill)


def test_a_prefill_of_another_file_is_a_mistake(tmp_path: Path) -> None:
    prefill = container.Prefill(tmp_path / "one.wcodec", 10)
    with pytest.raises(ValueError, match="not this writer's file"):
        container.Writer(tmp_path / "other.wcodec", prefill)
    prefill.discard()

