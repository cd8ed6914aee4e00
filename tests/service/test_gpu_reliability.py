"""Reliability on a GPU (skipped without one; scripts/gpu/run.sh (stage reliability) runs it on a lent
H100/H200): after every unload `torch.cuda.memory_allocated` is back at its baseline exactly and
`memory_reserved` stops growing; lying archives through the CUDA decoder give typed errors, and
on mutated streams the CUDA decoder and the server's CUDA loader agree bit for bit with the NumPy
reference (or all raise a typed error)."""
from __future__ import annotations

import collections
import gc
import os
import random
from pathlib import Path

import pytest
import torch

import cuda_ext
from tests.faults.archives import HEADER_LIES, base_archive, check_mutation, lying, outcome, readers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CYCLES = int(os.environ.get("WCODEC_GPU_CYCLES", "20"))
MUTATIONS = int(os.environ.get("WCODEC_GPU_MUTATIONS", "300"))
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(autouse=True)
def cuda_decoder() -> None:
    if not cuda_ext.available().cuda:
        pytest.skip(f"CUDA decoder unavailable: {cuda_ext.available().reason}")


@pytest.mark.anyio
@pytest.mark.timeout(900)
@pytest.mark.parametrize("resident", ["decoded", "compressed"])
@pytest.mark.parametrize("archive", ["tiny_archive", "demo_archive"])
async def test_allocated_returns_to_baseline_after_every_unload(serve, tmp_path, request, archive: str,
                                                                resident: str) -> None:
    (tmp_path / "store").mkdir()
    os.link(request.getfixturevalue(archive), tmp_path / "store" / "m.wcodec")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    allocated, reserved = [], []
    async with serve(tmp_path / "store") as server:
        name = "m"
        for _ in range(CYCLES):
            r = await server.client.post(f"/models/{name}/load", params={"weights": resident})
            assert r.status_code == 200 and r.json()["weights"] == resident, r.text
            body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
            assert (await server.client.post("/generate", json=body)).status_code == 200
            assert (await server.client.post(f"/models/{name}/unload")).status_code == 200
            gc.collect()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            reserved.append(torch.cuda.memory_reserved())
    print({"resident": resident, "cycles": CYCLES, "baseline": baseline, "allocated": sorted(set(allocated)),
           "reserved_mb": [r >> 20 for r in reserved[:3]] + [r >> 20 for r in reserved[-2:]]})
    assert allocated == [baseline] * CYCLES
    assert reserved[-1] <= reserved[2], [r >> 20 for r in reserved]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_archive(tmp_path_factory.mktemp("lies-gpu") / "base.wcodec")


@pytest.mark.parametrize("lie", list(HEADER_LIES))
def test_header_lies_through_cuda(base, tmp_path: Path, lie: str) -> None:
    archive, state = base
    path = tmp_path / "lie.wcodec"
    path.write_bytes(lying(archive, HEADER_LIES[lie]))
    for name in ("cuda", "cuda-nv", "server-loader-cuda", "server-loader-cuda-nv"):
        got = outcome(readers(cuda=True)[name], path, state)
        assert got.kind == "error", f"{name}: {got.kind} {got.detail}"


@pytest.mark.timeout(1800)
def test_mutations_through_cuda_agree_with_the_reference(base, tmp_path: Path) -> None:
    archive, state = base
    read = readers(cuda=True)
    rng, kinds, failures = random.Random(7), collections.Counter(), []
    for i in range(MUTATIONS):
        result = check_mutation(archive, state, rng, tmp_path, read)
        kinds.update(f"{n}:{o.kind}" for n, o in result.outcomes.items())
        failures += [f"#{i} {result.edits}: {f}" for f in result.failures]
    print(dict(sorted(kinds.items())))
    assert not failures, failures[:10]
