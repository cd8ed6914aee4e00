"""An unloaded model gives its memory back (issue 12). The growth was glibc keeping freed weight
blocks in its heap arenas, not a leak: bytes in use return to the same value after every unload
(below), and service/load/memory.py pins the mmap threshold and trims after an unload. The long form
(100 cycles) is `python scripts/reliability.py leak`; figures in docs/RELIABILITY.md."""
from __future__ import annotations

import gc
import os
import weakref

import pytest
from service_helpers import DEMO, generate_body

from service.load import memory
from tests.faults.leak import BASE_CYCLE, BOUND, run_cycles
from tests.faults.server import ServerProcess, rss_bytes

CYCLES = 8


def test_allocator_controls_are_there() -> None:
    assert memory.tune_allocator() and memory.release()
    stats = memory.malloc_stats()
    assert stats is not None and stats["in_use_bytes"] > 0 and stats["heap_bytes"] >= stats["in_use_bytes"]


@pytest.mark.anyio
@pytest.mark.timeout(400)
async def test_load_generate_unload_cycles_give_memory_back(serve, store) -> None:
    """Resident memory returns after each unload, and glibc's own accounting shows no leak: the
    bytes in use after an unload do not grow. (In-process, where the requests' and the loads'
    threads contend for malloc's arenas: without the fix RSS grew ~600 MB from cycle 2 to 8.)"""
    rss, in_use = [], []
    async with serve(store()) as server:
        for _ in range(CYCLES):
            assert (await server.client.post(f"/models/{DEMO}/load")).status_code == 200
            weight = weakref.ref(server.registry.get(DEMO).served.model.lm_head.weight)
            assert (await server.client.post("/generate", json=generate_body(2))).status_code == 200
            assert (await server.client.post(f"/models/{DEMO}/unload")).status_code == 200
            gc.collect()
            assert weight() is None
            rss.append(rss_bytes(os.getpid()))
            in_use.append(memory.malloc_stats()["in_use_bytes"])
    mb = [b >> 20 for b in rss]
    assert rss[-1] - rss[1] <= BOUND and max(rss[1:]) - rss[1] <= BOUND, mb
    assert in_use[-1] - in_use[1] <= 16 << 20, [b >> 20 for b in in_use]


@pytest.mark.timeout(400)
def test_a_server_process_gives_memory_back(store, tmp_path) -> None:
    """The same cycles against a real `wcodec serve` process on the loopback, as a user runs it."""
    with ServerProcess(store(), env={"WCODEC_DEVICE": "cpu"}, log=tmp_path / "server.log") as server:
        report = run_cycles(server, DEMO, BASE_CYCLE + 3)
    assert report.growth <= BOUND, report.summary()


def test_available_memory_is_the_containers_where_its_cgroup_leaves_less(tmp_path) -> None:
    """A pod's memory limit (cgroup v2's memory.max less memory.current, or v1's files) bounds what
    the host cache and the early read size themselves from; /proc/meminfo there is the node's."""
    from service.load.memory import available_memory
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1048576000 kB\nMemAvailable:    524288000 kB\n")   # 500 GiB free
    node = 524288000 * 1024

    def cgroup(limit: str, usage: str) -> tuple[tuple[str, str]]:
        (tmp_path / "max").write_text(limit + "\n")
        (tmp_path / "current").write_text(usage + "\n")
        return ((str(tmp_path / "max"), str(tmp_path / "current")),)
    assert available_memory(str(meminfo), ()) == node                                 # no cgroup files
    assert available_memory(str(meminfo), cgroup(str(32 << 30), str(6 << 30))) == 26 << 30
    assert available_memory(str(meminfo), cgroup("max", str(6 << 30))) == node        # v2: no limit
    assert available_memory(str(meminfo), cgroup(str((1 << 63) - 4096), "0")) == node  # v1: no limit
    assert available_memory(str(meminfo), cgroup(str(1 << 30), str(2 << 30))) == 0    # over: nothing
    assert available_memory(str(meminfo), cgroup(str(1 << 50), "0")) == node          # the node is less
