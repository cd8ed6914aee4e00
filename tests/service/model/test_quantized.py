"""GGUF blocks kept quantized in compressed-resident mode (service/model/quantized.py), with the
real demo archive (Q4_1 layers, a Q8_0 tied embedding): rows dequantized from the kept blocks
equal the decoded tensors bit for bit, no decoded copy of a matrix exists, the model gives decoded
mode's greedy tokens and logits, and a memory budget of 0.6x the bf16 bytes serves it (decoded
mode gets 507). The CUDA cases run on a lent GPU."""
from __future__ import annotations

import os

import pytest
import torch
from service_helpers import DEMO, generate_body
from test_compressed import PROMPTS, assert_same_greedy

from codec.decode import Archive
from cuda_ext import quant
from service.load import pipeline
from service.model import build, compressed, cpu_dtype, quantized

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU)")


def served(path, weights: str, device: str = "cpu") -> build.ServedModel:
    """A model as the server holds it (the CPU's compute mode applied)."""
    d = pipeline.decode_archive(path, torch.device(device), compressed=weights == "compressed")
    model = build.finish(DEMO, build.prepare(DEMO, d.files), d.tensors, d.layers, torch.device(device), blocks=d.blocks)
    return cpu_dtype.for_cpu(model, "auto")


@pytest.fixture(scope="module")
def kept_and_plain(demo_archive):
    cpu = torch.device("cpu")
    return (pipeline.decode_archive(demo_archive, cpu, compressed=True),
            pipeline.decode_archive(demo_archive, cpu))


def test_every_matrix_is_kept_as_blocks(kept_and_plain, demo_archive) -> None:
    kept, plain = kept_and_plain
    with Archive.open(demo_archive) as archive:
        entries = archive.entries
    matrices = {e.name for e in entries if len(e.shape) == 2}
    assert kept.blocks.keys() == matrices and kept.layers == []
    assert not matrices & kept.tensors.keys() and kept.tensors.keys() | matrices == plain.tensors.keys()
    assert {k.block.name for k in kept.blocks.values()} == {"Q4_1", "Q8_0"}
    for name, k in kept.blocks.items():
        entry = next(e for e in entries if e.name == name)
        assert k.nbytes == entry.params.n_blocks * entry.params.block.type_size


def test_rows_and_gathers_equal_the_decoded_tensor(kept_and_plain) -> None:
    kept, plain = kept_and_plain
    g = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        k, want = kept.blocks[name], plain.tensors[name]
        whole = torch.empty_like(want)
        quant.dequantize_rows(k.block, k.planes, whole)
        assert torch.equal(whole, want), name
        part = torch.empty(7, want.shape[1], dtype=want.dtype)
        quant.dequantize_rows(k.block, k.planes, part, start=want.shape[0] - 7)
        assert torch.equal(part, want[-7:]), name
        ids = torch.randint(0, want.shape[0], (33,), generator=g)
        rows = torch.empty(33, want.shape[1], dtype=want.dtype)
        quant.gather_rows(k.block, k.planes, ids, rows)
        assert torch.equal(rows, want[ids]), name


def test_no_decoded_copy_of_a_matrix(demo_archive) -> None:
    """The model holds no float matrix: only blocks, norms and the one shared (flat) scratch; and
    the bytes it reports are the load's estimate from the header."""
    model = served(demo_archive, "compressed")
    assert model.weights == "compressed" and model.schedule is None
    m = model.model
    assert isinstance(m.model.embed_tokens, quantized.BlockEmbedding) and isinstance(m.lm_head, quantized.BlockLinear)
    assert m.lm_head.plane0 is m.model.embed_tokens.plane0                  # the tied head: the same blocks
    scratches = {id(x.scratch) for x in m.modules() if isinstance(x, quantized.BlockLinear)}
    assert len(scratches) == 1 and m.lm_head.scratch.numel() == quantized.CHUNK // 576 * 576
    floats = [t.shape for t in [*m.parameters(), *m.buffers()] if t.is_floating_point() and t.dim() >= 2]
    assert floats == []                                                     # the scratch is flat: [CHUNK]
    with Archive.open(demo_archive) as archive:
        entries = archive.entries
    assert model.weight_bytes == compressed.estimate_bytes(entries, scratch=1)
    assert model.weight_bytes < 0.4 * sum(e.nbytes for e in entries)


@pytest.fixture(scope="module")
def both_modes(demo_archive):
    return served(demo_archive, "decoded"), served(demo_archive, "compressed")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("batch", [1, 8])
def test_same_tokens_and_logits_as_decoded_mode(both_modes, batch) -> None:
    assert_same_greedy(*both_modes, batch, prompts=PROMPTS)


@pytest.mark.timeout(900)
def test_mixed_cpu_gives_decoded_modes_tokens_and_logits(demo_archive, monkeypatch) -> None:
    """Where bf16 is not native to the CPU (no AVX512-BF16: decoded mode multiplies in float32 from
    6 rows), each block Linear dequantizes one of decoded mode's blocks of rows at a time into the
    mixed matmul, widened in its scratch's tail: the same bits, and no byte more than the estimate."""
    monkeypatch.setattr(cpu_dtype, "linear16_kernel", lambda dtype: False)
    monkeypatch.setattr(cpu_dtype, "_native", lambda dtype: False)
    decoded, kept = served(demo_archive, "decoded"), served(demo_archive, "compressed")
    assert isinstance(decoded.model.lm_head, cpu_dtype.MixedLinear)
    assert isinstance(kept.model.lm_head.kernel, cpu_dtype.MixedMatmul)
    assert kept.model.lm_head.rows == cpu_dtype.CHUNK_FLOATS // 576                  # 1820: decoded mode's blocks
    with Archive.open(demo_archive) as archive:
        assert kept.weight_bytes == compressed.estimate_bytes(archive.entries, scratch=1)
    assert_same_greedy(decoded, kept, batch=6, steps=8)                              # the head at 6 rows too


@pytest.mark.timeout(900)
@CUDA
@pytest.mark.parametrize("batch", [1, 8])
def test_same_tokens_as_decoded_mode_on_cuda(demo_archive, batch) -> None:
    """On a GPU each Linear of blocks is a dequantize launch and cuBLAS on the scratch: the same
    weights as decoded mode's, multiplied by the same library (the head in chunks of rows)."""
    assert_same_greedy(served(demo_archive, "decoded", "cuda"), served(demo_archive, "compressed", "cuda"), batch,
                       exact_logits=False)


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
async def test_budget_of_0_6_bf16_serves_only_compressed(serve, store, device) -> None:
    async with serve(store(), device=device) as server:
        c = server.client
        decoded_bytes = (await c.get(f"/models/{DEMO}")).json()["decoded_bytes"]
        in_use = torch.cuda.memory_allocated() if server.registry.device.type == "cuda" else 0   # other tests' models
        server.registry.settings.gpu_memory_budget = int(0.6 * decoded_bytes) + in_use
        r = await c.post(f"/models/{DEMO}/load", params={"weights": "decoded"})
        assert r.status_code == 507 and r.json()["error_type"] == "insufficient_memory", r.text
        r = await c.post(f"/models/{DEMO}/load", params={"weights": "compressed"})
        assert r.status_code == 200, r.text
        assert r.json()["weights"] == "compressed" and r.json()["weight_bytes"] <= 0.6 * decoded_bytes
        r = await c.post("/generate", json=generate_body())
        assert r.status_code == 200 and r.json()["generated_text"].startswith("The capital of France is Paris"), r.text
        assert (await c.post(f"/models/{DEMO}/unload")).status_code == 200


@pytest.mark.anyio
async def test_a_transformers_model_counts_its_blocks_dequantized(serve, tmp_path, mistral_gguf_archive,
                                                                  monkeypatch) -> None:
    """transformers' classes hold no block modules: a GGUF archive they serve (here named "mistral":
    MistralForCausalLM, which llama.py would serve but for the patch standing in for a config it
    does not) gets its blocks dequantized at the load in compressed mode too, and is held decoded.
    The budget's estimate and /models count those bytes, as the metrics do: the demo's counted
    only its norms (70 KB of 269 MB) and its estimate only the blocks."""
    from service.model import llama
    monkeypatch.setattr(llama.LlamaConfig, "parse", classmethod(lambda cls, d, context=None: None))
    (tmp_path / "store").mkdir()
    os.link(mistral_gguf_archive, tmp_path / "store" / "m.wcodec")
    with Archive.open(mistral_gguf_archive) as archive:
        dequantized = sum(e.nbytes for e in archive.entries)
    async with serve(tmp_path / "store") as server:
        c = server.client
        server.registry.settings.gpu_memory_budget = dequantized - 1
        r = await c.post("/models/m/load", params={"weights": "compressed"})
        assert r.status_code == 507 and r.json()["error_type"] == "insufficient_memory", r.text
        server.registry.settings.gpu_memory_budget = dequantized
        r = await c.post("/models/m/load", params={"weights": "compressed"})
        assert r.status_code == 200 and r.json()["weights"] == "decoded", r.text
        assert type(server.registry.get("m").served.model).__name__ == "MistralForCausalLM"
        assert r.json()["weight_bytes"] == dequantized == server.registry.used_bytes()
        assert await server.metric("wcodec_model_weight_bytes", model="m", weights="decoded") == dequantized


@pytest.mark.anyio
@pytest.mark.parametrize(("context", "window"), [(4096, None), (4097, 4096)])
async def test_a_window_no_request_reaches_is_no_window(serve, tmp_path, mistral_gguf_archive, context: int,
                                                        window: int | None) -> None:
    """The GGUF "mistral" (a 4096-token window, 8192 positions), served by llama.py, its blocks
    kept (compressed mode), under WCODEC_MAX_TOTAL_TOKENS: at 4096 no request reaches past its
    window, which is then no window; at 4097 one does, and the window applies. The budget's
    estimate makes the same choice (Loader.estimate_bytes: it equals the load's bytes)."""
    (tmp_path / "store").mkdir()
    os.link(mistral_gguf_archive, tmp_path / "store" / "m.wcodec")
    async with serve(tmp_path / "store", max_total_tokens=context) as server:
        r = await server.client.post("/models/m/load", params={"weights": "compressed"})
        assert r.status_code == 200 and r.json()["weights"] == "compressed", r.text
        entry = server.registry.get("m")
        assert type(entry.served.model).__name__ == "LlamaForCausalLM"
        assert entry.served.model.config.sliding_window == window
        estimate = server.registry.loader.estimate_bytes(entry.file.path, "compressed")
        assert estimate == r.json()["weight_bytes"]
