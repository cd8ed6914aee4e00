"""The memory budget charges a load its whole need before it starts (registry.py, Loader.estimate_bytes):
every buffer the load makes, the CPU compute setting's included (linear16's packed copy of a tied
head, the mixed matmul's float32 scratch, the float32 cast), so that a budget one byte short
refuses the load with nothing read, and the load's own figure is checked against the charge. Every
archive here is served by llama.py (a Qwen3's q_norm and k_norm are 1-D, held decoded in both modes)."""
from __future__ import annotations

import logging
import os

import pytest
from service_helpers import DEMO, FileReads

from service.model import llama
from service.registry import ModelState

pytestmark = pytest.mark.anyio

# (archive, weights, WCODEC_CPU_DTYPE, WCODEC_CPU_SIMD): on an AVX-512 CPU `auto` is linear16 (the
# tied head's packed copy, decoded), with SIMD off the mixed matmul (its scratch); the compressed
# demo's scratch fits in its blocks' one, the tiny models' (float-coded layers kept) does not.
CASES = [
    ("demo", "decoded", "auto", "1"), ("demo", "compressed", "auto", "1"),
    ("demo", "decoded", "float32", "1"), ("demo", "decoded", "auto", "0"),
    ("tiny", "decoded", "auto", "1"), ("tiny", "compressed", "auto", "1"),
    ("tiny", "decoded", "auto", "0"), ("tiny", "compressed", "auto", "0"),
    ("untied", "compressed", "float32", "0"), ("fp16", "decoded", "auto", "1"),
    ("fp8", "decoded", "auto", "0"), ("fp8", "compressed", "float32", "1"),     # held dequantized (fp8.py)
    ("qwen3", "decoded", "auto", "1"), ("qwen3", "compressed", "auto", "1"),      # q_norm, k_norm: 1-D, decoded
    ("qwen3", "decoded", "auto", "0"), ("qwen3", "compressed", "float32", "0"),
]


@pytest.fixture
def one_model(tmp_path, request):
    """A store holding one archive (by CASES' name), and the model's name in it."""
    def make(which: str):
        archive = request.getfixturevalue("fp8_archives")("fp8")[0] if which == "fp8" else request.getfixturevalue(
            {"demo": "demo_archive", "tiny": "tiny_archive", "untied": "untied_tiny_archive",
             "fp16": "fp16_tiny_archive", "qwen3": "qwen3_tiny_archive"}[which])
        root = tmp_path / "store"
        root.mkdir()
        name = DEMO if which == "demo" else which
        os.link(archive, root / f"{name}.wcodec")
        return root, name
    return make


async def _need(server, name: str, weights: str) -> int:
    """The bytes the model takes as held, loaded once without a budget and unloaded."""
    r = await server.client.post(f"/models/{name}/load", params={"weights": weights})
    assert r.status_code == 200, r.text
    need = r.json()["weight_bytes"]
    assert (await server.client.post(f"/models/{name}/unload")).status_code == 200
    return need


def _count_loads(server, monkeypatch) -> list[str]:
    """The names of the models whose weights the loader is asked to load from now on."""
    loads, load = [], server.registry.loader.load

    def counting(name, *args):
        loads.append(name)
        return load(name, *args)
    monkeypatch.setattr(server.registry.loader, "load", counting)
    return loads


@pytest.mark.parametrize(("which", "weights", "cpu_dtype", "simd"), CASES)
async def test_a_budget_one_byte_short_refuses_the_load_before_reading_it(
        serve, one_model, monkeypatch, which, weights, cpu_dtype, simd) -> None:
    """One byte under the model's need as held: 507, and not a byte of its weights read or decoded
    (the estimate left out the CPU's buffers, 57 MB of a packed head on the demo: the load ran and
    took them, over the budget). Exactly its need: it loads, charged as /models and the metrics say."""
    monkeypatch.setenv("WCODEC_CPU_SIMD", simd)
    root, name = one_model(which)
    async with serve(root, cpu_dtype=cpu_dtype) as server:
        need = await _need(server, name, weights)
        server.registry.settings.gpu_memory_budget = need - 1
        reads, loads = FileReads(monkeypatch), _count_loads(server, monkeypatch)
        r = await server.client.post(f"/models/{name}/load", params={"weights": weights})
        assert r.status_code == 507 and r.json()["error_type"] == "insufficient_memory", r.text
        assert loads == [] and reads.opened == [] and reads.bytes == 0
        assert server.registry.get(name).state is ModelState.AVAILABLE and server.registry.used_bytes() == 0
        server.registry.settings.gpu_memory_budget = need
        r = await server.client.post(f"/models/{name}/load", params={"weights": weights})
        assert r.status_code == 200 and r.json()["weight_bytes"] == need, r.text
        assert server.registry.used_bytes() == need == await server.metric(
            "wcodec_model_weight_bytes", model=name, weights=r.json()["weights"])
        assert loads == [name]
        assert isinstance(server.registry.get(name).served.model, llama.LlamaForCausalLM)    # linear_weights' estimate


async def test_a_load_over_its_estimate_is_logged_and_kept_where_the_budget_holds_it(
        serve, one_model, monkeypatch, caplog) -> None:
    """A load that took more than its estimate (a buffer Loader.estimate_bytes does not know of):
    an error in the log naming the difference; the model is kept, charged its own figure."""
    root, name = one_model("tiny")
    async with serve(root) as server:
        need = await _need(server, name, "decoded")
        monkeypatch.setattr(server.registry.loader, "estimate_bytes", lambda *a: need - 100)
        with caplog.at_level(logging.ERROR, logger="wcodec.service"):
            r = await server.client.post(f"/models/{name}/load")
        assert r.status_code == 200 and server.registry.used_bytes() == need, r.text
        assert [rec.getMessage() for rec in caplog.records if "100 more than the estimate" in rec.getMessage()]


async def test_a_load_over_its_estimate_and_the_budget_fails_and_gives_its_memory_back(
        serve, one_model, monkeypatch) -> None:
    """Where the budget cannot hold what the load took past its estimate, the load fails (507) and
    charges nothing: no load leaves the budget exceeded."""
    root, name = one_model("tiny")
    async with serve(root) as server:
        need = await _need(server, name, "decoded")
        monkeypatch.setattr(server.registry.loader, "estimate_bytes", lambda *a: need - 100)
        server.registry.settings.gpu_memory_budget = need - 50
        r = await server.client.post(f"/models/{name}/load")
        assert r.status_code == 507 and "more than its estimate" in r.json()["error"], r.text
        entry = server.registry.get(name)
        assert entry.state is ModelState.FAILED and entry.served is None and server.registry.used_bytes() == 0
        assert await server.metric("wcodec_model_loads_total", model=name, result="oom") == 1
