"""Crash safety: kill -9 in the middle of a server's load and of `wcodec compress`.

* A server killed while it loads a model leaves the store as it was (same bytes, no new files),
  and the next server start loads the model.
* `wcodec compress` killed at any moment never leaves a file that a reader accepts: the archive
  is written beside DST (DST.<pid>-<hex>.tmp) with the preamble (the magic) last, then renamed.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from codec.decode import Archive, load
from codec.errors import CodecError

from .server import REPO, ServerProcess


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def kill_during_load(store: Path, model: str, after_bytes: int, log: Path | None = None) -> dict:
    """Start a server, load `model` (wait=false), kill -9 once `after_bytes` are decoded."""
    with ServerProcess(store, env={"WCODEC_DEVICE": "cpu"}, log=log) as server:
        r = httpx.post(f"{server.url}/models/{model}/load", params={"wait": "false"}, timeout=60)
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = httpx.get(f"{server.url}/models/{model}", timeout=30).json()
            if info["progress"]["bytes_done"] >= after_bytes or info["state"] != "loading":
                break
            time.sleep(0.01)
        status = server.kill(signal.SIGKILL)
    return {"state_at_kill": info["state"], "bytes_done": info["progress"]["bytes_done"], "exit": status}


def reader_accepts(path: Path) -> bool:
    try:
        with Archive.open(path):
            return True
    except CodecError:
        return False


def kill_compress(src: Path, dst: Path, at_bytes: int | None) -> dict:
    """Run `wcodec compress src dst`; kill -9 its whole process group once its file beside DST holds `at_bytes`
    bytes (None: let it finish). Which files it left, which a reader opens, and which of those are
    not the complete archive. Progress, not a clock, picks the moment: the encoder's speed varies
    by machine, the bytes on disk do not."""
    proc = subprocess.Popen([sys.executable, "-m", "wcodec", "compress", str(src), str(dst), "--workers", "2"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and at_bytes is not None and time.monotonic() < deadline:
        if _written(dst) >= at_bytes:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait(None if at_bytes is None else 30)
    left = sorted(p for p in dst.parent.iterdir() if p.name.startswith(dst.name))
    accepted = [p for p in left if reader_accepts(p)]
    return {"killed": proc.returncode == -signal.SIGKILL, "exit": proc.returncode, "left": [p.name for p in left],
            "accepted": [p.name for p in accepted],
            "accepted_partial": [p.name for p in accepted if p != dst or not complete(p)]}


def _written(dst: Path) -> int:
    """Bytes in the compress's file beside `dst` (codec/container.temp_path: DST.<pid>-<hex>.tmp),
    -1 while there is none."""
    sizes = []
    for tmp in dst.parent.glob(dst.name + ".*.tmp"):
        try:
            sizes.append(tmp.stat().st_size)
        except FileNotFoundError:                # renamed or removed meanwhile
            pass
    return max(sizes, default=-1)


def complete(path: Path) -> bool:
    """Every tensor decodes and matches its CRC32: the archive the compress meant to write (a kill
    after the rename, while the process was exiting, leaves it)."""
    try:
        load(path, workers=1)
        return True
    except CodecError:
        return False
