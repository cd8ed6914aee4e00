"""codec/preload.py: a shared library dlopened with the GIL released, against stand-in libraries
whose static initialiser takes a while (the thread beside it keeps running Python), and the
preload thread's order and stop at the first library that does not load."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from codec import preload

SLOW_INIT = r"""
#include <unistd.h>
int initialised = 0;
__attribute__((constructor)) static void init(void) { usleep(300000); initialised = 1; }
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("preload")
    (d / "slow.c").write_text(SLOW_INIT)
    for name in ("a", "b", "c"):
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / f"lib{name}.so"), str(d / "slow.c")], check=True)
    return d


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_loads_with_the_gil_released(libs: Path) -> None:
    """The main thread counts while a thread dlopens a library whose initialiser takes 0.3 s."""
    done, counts = threading.Event(), [0]

    def load() -> None:
        assert preload.dlopen_released(libs / "liba.so")
        done.set()

    thread = threading.Thread(target=load)
    started = time.perf_counter()
    thread.start()
    while not done.is_set():
        counts[0] += 1
    thread.join()
    assert time.perf_counter() - started >= 0.25 and _mapped(libs / "liba.so")
    assert counts[0] > 100_000                  # a dlopen holding the GIL leaves a few thousand at most


def test_a_missing_or_bad_library_is_false(tmp_path: Path) -> None:
    (tmp_path / "bad.so").write_bytes(b"\x7fELF half a library")
    assert not preload.dlopen_released(tmp_path / "missing.so")
    assert not preload.dlopen_released(tmp_path / "bad.so")


def test_start_loads_in_order_and_stops_at_the_first_failure(libs: Path, tmp_path: Path) -> None:
    spans: list[str] = []

    def span(name: str):
        spans.append(name)
        return preload._untimed(name)

    mode = preload.RTLD_NOW | preload.RTLD_LOCAL
    preload.start([(libs / "libb.so", mode), (tmp_path / "missing.so", mode), (libs / "libc.so", mode)],
                  span=span).join()
    assert _mapped(libs / "libb.so") and not _mapped(libs / "libc.so")
    assert spans == ["dlopen libb.so (GIL released)", "dlopen missing.so (GIL released)"]
