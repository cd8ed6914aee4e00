"""Start-up: `wcodec serve` reads and decodes its preloaded models while it imports, reports the
real process-start-to-ready time, and a corrupt preloaded archive still fails typed, unloaded."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from service_helpers import DEMO, FileReads, generate_body

from service.load.early_read import start_early_reads
from service.load.early_load import start_early_loads
from service.settings import Settings
from service.timeline import Timeline

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wcodec_serve_preloads_from_its_first_instant(store) -> None:
    root, port = store(), _port()
    env = {**os.environ, "WCODEC_MODEL_STORE": str(root), "WCODEC_PRELOAD": json.dumps([DEMO]),
           "WCODEC_DEMO": "false", "WCODEC_DEVICE": "cpu", "WCODEC_LOG_LEVEL": "debug"}
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "wcodec", "serve", "--port", str(port)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            while True:
                assert proc.poll() is None and time.time() - started < 300
                try:
                    if client.get("/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            waited = time.time() - started
            assert client.post("/generate", json=generate_body(max_new_tokens=3)).status_code == 200
            startup = client.get("/health/startup").json()
            metrics = client.get("/metrics").text
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    names = [e["name"] for e in startup["timeline"]]
    at = {n: e for e in reversed(startup["timeline"]) for n in [e["name"]]}
    ready = startup["process_start_to_ready_s"]
    assert 0 < ready <= waited + 0.5
    assert f"wcodec_process_start_to_ready_seconds {ready}" in metrics
    early_read = next(n for n in names if n.startswith("early read") and "pieces" in n)
    assert at[early_read]["start"] <= at["import torch"]["start"]                   # reads begin before torch
    decoded = next(n for n in names if n.startswith("early load") and "batches decoded" in n)
    assert at[decoded]["start"] > at["import torch"]["end"]
    assert "start-up timeline" in log and "import uvicorn, fastapi and the service" in log


def _early(root: Path, name: str, verify: bool = True) -> tuple[dict, Timeline]:
    settings = Settings(model_store=root, preload=[name], demo=False, verify_crc=verify)
    paths = {name: str(root / f"{name}.wcodec")}
    timeline = Timeline()
    reads = start_early_reads(paths, verify=verify, threads=2, direct=None, timeline=timeline)
    return start_early_loads(reads, paths, settings, torch.device("cpu"), timeline), timeline


async def test_the_preload_takes_the_early_load(serve, store) -> None:
    root = store()
    from service.app import create_app
    settings = Settings(model_store=root, preload=[DEMO], demo=False)
    early, timeline = _early(root, DEMO)
    app = create_app(settings, early=early, timeline=timeline)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            await app.state.registry.startup
            assert (await client.get("/health/ready")).status_code == 200
            info = (await client.get(f"/models/{DEMO}")).json()
            assert info["progress"]["bytes_done"] == info["progress"]["bytes_total"] > 0
            assert (await client.post("/generate", json=generate_body())).json()["generated_text"]
            names = [e["name"] for e in (await client.get("/health/startup")).json()["timeline"]]
    assert any(n.startswith(f"early load {DEMO}: 32 batches decoded") for n in names)
    assert not any(n.startswith(f"load {DEMO}: header") for n in names)                # not loaded twice


async def test_a_preloaded_model_switched_out_and_back_reads_no_file(serve, store, monkeypatch) -> None:
    root = store()
    from service.app import create_app
    settings = Settings(model_store=root, preload=[DEMO], demo=False)
    early, timeline = _early(root, DEMO)
    read = early[DEMO].read
    app = create_app(settings, early=early, timeline=timeline)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            await app.state.registry.startup
            cache = app.state.registry.host_cache
            assert cache.peek(str(root / f"{DEMO}.wcodec")) is read and len(cache) == 1   # the start-up read, kept
            assert (await client.post(f"/models/{DEMO}/unload")).json()["state"] == "available"
            reads = FileReads(monkeypatch)
            again = (await client.post(f"/models/{DEMO}/load")).json()
            assert again["state"] == "ready" and again["last_load"]["source"] == "host cache"
            assert reads.opened == [] and reads.bytes == 0                     # not a byte of the file
            assert (await client.post("/generate", json=generate_body())).json()["generated_text"]


def test_a_start_up_read_not_taken_is_freed(store) -> None:
    root = store()
    early, _ = _early(root, DEMO)
    load = early[DEMO]
    read = load.read
    assert read is not None and read.kept
    load.release()                                                # the registry did not use it
    assert load.read is None and not read.kept and read._freed


async def test_a_corrupt_preload_fails_typed_and_stays_unloaded(tmp_path: Path, demo_archive: Path) -> None:
    from service.app import create_app
    data = bytearray(demo_archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    root = tmp_path / "store"
    root.mkdir()
    (root / "bad.wcodec").write_bytes(bytes(data))
    early, timeline = _early(root, "bad")
    app = create_app(Settings(model_store=root, preload=["bad"], demo=False), early=early, timeline=timeline)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            await app.state.registry.startup
            ready = await client.get("/health/ready")
            info = (await client.get("/models/bad")).json()
    assert ready.status_code == 503 and "checksum" in ready.json()["error"]
    assert info["state"] == "failed" and "XXH3-64" in info["last_error"]


def test_the_short_switch_interval_ends_once_the_early_reads_are_in() -> None:
    import sys
    import threading
    import time

    from wcodec.serve import IMPORT_SWITCH_INTERVAL, _restore_once_read

    class Read:
        end = 100

        def __init__(self) -> None:
            self.done = threading.Event()

        def wait_until(self, end: int) -> None:
            self.done.wait()

    before, read = sys.getswitchinterval(), Read()
    sys.setswitchinterval(IMPORT_SWITCH_INTERVAL)
    try:
        _restore_once_read({"m": read}, before)
        time.sleep(0.05)
        assert sys.getswitchinterval() == IMPORT_SWITCH_INTERVAL       # still reading
        read.done.set()
        deadline = time.monotonic() + 5
        while sys.getswitchinterval() != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
