"""The storm (tests/faults/storm.py): 32 concurrent clients for a fixed time against a real
`wcodec serve` process on the loopback, mixing generation (some streams hung up on mid-way),
OpenAI's chat and completions, load, unload, load?wait=false, model listing and /metrics. Only
statuses the OpenAPI schema documents, no 5xx but 503 (not ready), no hang; afterwards nothing is in flight and the demo
still answers "Paris". The long form is `python scripts/reliability.py storm`."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from service_helpers import DEMO

from tests.faults.server import ServerProcess
from tests.faults.storm import answers_paris, run_storm, settle, wait_ready

CLIENTS, SECONDS = 32, 30


@pytest.mark.timeout(400)
def test_storm(store, tmp_path) -> None:
    env = {"WCODEC_DEVICE": "cpu", "WCODEC_PRELOAD": f'["{DEMO}"]'}
    with ServerProcess(store(), env=env, log=tmp_path / "server.log") as server:
        asyncio.run(wait_ready(server.url))
        report = asyncio.run(run_storm(server.url, DEMO, clients=CLIENTS, seconds=SECONDS, seed=1,
                                       unload_every_s=10))
        print(report.summary())
        assert not report.problems(), report.summary()
        assert report.requests > CLIENTS and report.disconnects > 0 and report.streams_complete > 0
        assert report.actions["unload"] >= 1 and report.statuses["POST /generate 200"] > 0
        assert report.statuses["POST /v1/completions 200"] > 0 and report.statuses["POST /v1/completions 400"] > 0
        models = asyncio.run(settle(server.url))
        assert all(m["in_flight"] == 0 for m in models), models
        assert asyncio.run(answers_paris(server.url, DEMO)).startswith("The capital of France is Paris")
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f'wcodec_model_loads_total{{model="{DEMO}",result="failed"}} 0.0' in metrics
        assert server.proc.poll() is None
