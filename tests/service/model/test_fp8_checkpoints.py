"""fp8 checkpoints served (service/model/fp8.py): compressed-tensors' per-tensor scales,
fbgemm's per-row scales and transformers' FineGrainedFP8 blocks (ragged ones included) come out
of the load as exactly the bf16 weights the checkpoint means, scales and activation/kv-cache
scales dropped; the server then generates what their bf16 twin generates, charged the bytes it
holds; a quantization it cannot serve is refused by name before a byte of weights is read."""
from __future__ import annotations

import json
import os

import pytest
import torch
from service_helpers import FileReads

from codec.encode import compress_state_dict
from service.load import pipeline
from service.model import fp8, fp8_linear

pytestmark = pytest.mark.anyio
METHODS = ["compressed-tensors", "fbgemm_fp8", "fp8"]      # conftest.FP8_FORMATS'


@pytest.mark.parametrize("method", METHODS)
def test_the_load_dequantizes_each_weight_as_its_checkpoint_means(fp8_archives, method) -> None:
    archive, twin = fp8_archives(method)
    meant = pipeline.decode_archive(twin, torch.device("cpu")).tensors
    with_scales = pipeline.decode_archive(archive, torch.device("cpu"))
    s = fp8.scheme_of([e for e in _entries(archive)], with_scales.files)
    got = pipeline.decode_archive(archive, torch.device("cpu"), fp8_scheme=s).tensors
    assert any(t.dtype == torch.float8_e4m3fn for t in with_scales.tensors.values())
    assert sorted(got) == sorted(meant)                       # scales, input and kv-cache scales dropped
    for name, t in meant.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def _entries(path):
    from codec.decode import Archive
    with Archive.open(path) as archive:
        return archive.entries


def _store(tmp_path, **archives):
    root = tmp_path / "store"
    root.mkdir()
    for name, path in archives.items():
        os.link(path, root / f"{name}.wcodec")
    return root


async def _greedy(client, name: str, prompt: str) -> list[tuple[int, float]]:
    r = await client.post("/generate", json={"inputs": prompt, "model": name,
                                             "parameters": {"max_new_tokens": 12, "details": True}})
    assert r.status_code == 200, r.text
    return [(t["id"], t["logprob"]) for t in r.json()["details"]["tokens"]]


@pytest.mark.parametrize("weights", ["decoded", "compressed"])
@pytest.mark.parametrize("method", METHODS)
async def test_an_fp8_model_generates_what_its_bf16_twin_does(serve, fp8_archives, tmp_path, method, weights) -> None:
    archive, twin = fp8_archives(method)
    async with serve(_store(tmp_path, fp8=archive, twin=twin)) as server:
        loads = [await server.client.post(f"/models/{n}/load", params={"weights": weights}) for n in ("fp8", "twin")]
        assert [r.status_code for r in loads] == [200, 200], [r.text for r in loads]
        held = [r.json()["weight_bytes"] for r in loads]
        assert held[0] == held[1] or weights == "compressed"  # as bf16; the twin's compressed form is smaller
        for prompt in ("What is the capital of France?", "The capital"):
            got, twin_got = await _greedy(server.client, "fp8", prompt), await _greedy(server.client, "twin", prompt)
            assert [t for t, _ in got] == [t for t, _ in twin_got]
            # the same weights: the same logprobs, bit for bit on the CPU; on CUDA a request's first steps
            # run the modules' kernels or Triton's as each engine's warm-up allows (test_gpu.same_answer),
            # (1.9e-3 apart seen on an H200, 2026-12-01), and compressed mode's Fp8Linears sum the
            # checkpoint's own products (fp8_linear.py)
            served = server.registry.get("fp8").served
            kept = any(isinstance(m, fp8_linear.Fp8Linear) for m in served.model.modules())
            tolerance = 0.0 if served.device.type == "cpu" else 2e-2 if kept else 1e-2
            assert all(abs(a - b) <= tolerance for (_, a), (_, b) in zip(got, twin_got)), (got, twin_got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 weights are kept on CUDA only (the W8A16 op's)")
@pytest.mark.parametrize("method", ["compressed-tensors", "fbgemm_fp8"])
async def test_compressed_mode_on_cuda_holds_fp8_weights_as_their_bytes(serve, fp8_archives, tmp_path, monkeypatch,
                                                                         method) -> None:
    """Each fp8 Linear is an Fp8Linear holding the checkpoint's e4m3 bytes and float32 scales (a
    byte a weight where decoded mode holds two), its decode steps run the W8A16 op, and the
    budget's estimate charges those bytes."""
    from cuda_ext import fp8 as fp8_ops
    calls = []
    monkeypatch.setattr(fp8_ops, "linear", lambda *a, f=fp8_ops.linear: calls.append(1) or f(*a))
    archive, _ = fp8_archives(method)
    entries = {e.name: e for e in _entries(archive)}
    weights = [e for e in entries.values() if e.torch_dtype == torch.float8_e4m3fn]
    async with serve(_store(tmp_path, fp8=archive)) as server:
        decoded = server.registry.loader.estimate_bytes(archive, "decoded")
        need = server.registry.loader.estimate_bytes(archive, "compressed")
        r = await server.client.post("/models/fp8/load", params={"weights": "compressed"})
        assert r.status_code == 200, r.text
        model = server.registry.get("fp8").served.model
        held = {n: m for n, m in model.named_modules() if isinstance(m, fp8_linear.Fp8Linear) and not n.endswith("_linear")}
        assert sorted(f"{n}.weight" for n in held) == sorted(e.name for e in weights)
        scales = sum(entries[f"{n}.weight_scale"].numel * 4 for n in held)
        assert sum(m.weight8.nbytes for m in held.values()) == sum(e.numel for e in weights)
        # float32 scales; a joined one's a scale a row (a tensor's repeated: fp8_linear.Fp8Linear.join)
        assert all(m.scale.dtype == torch.float32 and m.scale.numel() <= m.out_features for m in held.values())
        assert need == decoded - sum(e.numel for e in weights) + scales        # a byte a weight, not two
        assert r.json()["weight_bytes"] <= need
        got = await _greedy(server.client, "fp8", "What is the capital of France?")
        assert len(got) == 12 and calls


async def test_the_budget_charges_an_fp8_model_its_dequantized_bytes(serve, fp8_archives, tmp_path) -> None:
    """The estimate before the load counts each fp8 weight at bf16's 2 bytes, no scale: a budget one
    byte short of that refuses it, that budget loads it (the header's fp8 bytes are fewer)."""
    archive, _ = fp8_archives("fp8")
    async with serve(_store(tmp_path, fp8=archive)) as server:
        need = server.registry.loader.estimate_bytes(archive, "decoded")
        header = sum(e.nbytes for e in _entries(archive))
        server.registry.settings.gpu_memory_budget = need - 1
        r = await server.client.post("/models/fp8/load")
        assert r.status_code == 507 and need > header, r.text
        server.registry.settings.gpu_memory_budget = need
        r = await server.client.post("/models/fp8/load")
        assert r.status_code == 200 and r.json()["weight_bytes"] == need, r.text


@pytest.mark.parametrize(("qconfig", "named"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "only 8-bit float"),
])
async def test_a_quantization_it_cannot_serve_is_refused_by_name_before_reading_weights(
        serve, tmp_path, monkeypatch, tiny_state, qconfig, named) -> None:
    state, files = tiny_state(tmp_path)
    config = json.loads(files["config.json"]) | {"quantization_config": qconfig}
    compress_state_dict(state, tmp_path / "q.wcodec", files={**files, "config.json": json.dumps(config).encode()},
                        workers=1)
    async with serve(_store(tmp_path, q=tmp_path / "q.wcodec")) as server:
        reads = FileReads(monkeypatch)
        r = await server.client.post("/models/q/load")
        assert r.status_code == 500 and r.json()["error_type"] == "load_failed", r.text
        assert named in r.json()["error"] and "not supported" in r.json()["error"]
        assert reads.bytes == 0


@pytest.mark.parametrize(("rows", "cols", "grid", "block"), [
    (300, 200, (3, 2), (128, 128)), (70, 50, (10, 5), (7, 10)), (64, 64, (64, 1), None), (64, 64, (1, 1), None)])
@pytest.mark.parametrize("chunk_rows", [1, 37, 1 << 16])
def test_chunks_that_cut_a_block_of_rows_dequantize_as_the_whole(monkeypatch, rows, cols, grid, block,
                                                                 chunk_rows) -> None:
    """CHUNK weights at a time, wherever a chunk's rows start in a block of scales (ragged blocks too):
    the result is the whole matrix times its scales, rounded once."""
    torch.manual_seed(0)
    w, scale = torch.randn(rows, cols).to(torch.float8_e4m3fn), torch.rand(grid) + 0.5
    bo, bi = block or (-(-rows // grid[0]), -(-cols // grid[1]))
    meant = (w.float() * torch.kron(scale, torch.ones(bo, bi))[:rows, :cols]).to(torch.bfloat16)
    monkeypatch.setattr(fp8, "CHUNK", chunk_rows * cols)
    assert torch.equal(fp8.dequantize({"m.weight": w, "m.weight_scale_inv": scale},
                                      fp8.Scheme("fp8", torch.bfloat16, block))["m.weight"], meant)
