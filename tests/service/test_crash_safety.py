"""kill -9 during a server's load leaves the store intact, and the next start loads the model and
answers (tests/faults/crash.py)."""
from __future__ import annotations

import asyncio

import pytest
from service_helpers import DEMO

from tests.faults.crash import digest, kill_during_load
from tests.faults.server import ServerProcess
from tests.faults.storm import answers_paris, wait_ready


@pytest.mark.timeout(400)
@pytest.mark.parametrize("after_bytes", [100 << 20], ids=["mid-decode"])      # the long form also kills at the start
def test_kill_during_load_leaves_the_store_intact(store, tmp_path, after_bytes: int) -> None:
    root = store()
    before = digest(root)
    killed = kill_during_load(root, DEMO, after_bytes, log=tmp_path / "killed.log")
    assert killed["state_at_kill"] == "loading" and killed["exit"] == -9, killed
    assert digest(root) == before
    env = {"WCODEC_DEVICE": "cpu", "WCODEC_PRELOAD": f'["{DEMO}"]'}
    with ServerProcess(root, env=env, log=tmp_path / "next.log") as server:
        asyncio.run(wait_ready(server.url))
        assert asyncio.run(answers_paris(server.url, DEMO)).startswith("The capital of France is Paris")
    assert digest(root) == before
