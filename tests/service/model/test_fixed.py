"""The fixed-rate form in compressed-resident mode (service/model/fixed.py), on the real demo model
float-coded (`--gguf dense`): every float matrix transcoded at load and multiplied by its own op,
the embedding decoded back, the load's estimate above what it holds, decoded mode's tokens (and
on the CPU, where the op decodes and multiplies with PyTorch, its logits bit for bit). On CUDA
(a lent GPU): the fused op, decoded mode's greedy tokens, and a budget of 0.8x bf16 that only
this mode fits through the server."""
from __future__ import annotations

import pytest
import torch
from service_helpers import DEMO, generate_body
from test_compressed import assert_same_greedy

from codec.decode import Archive
import cuda_ext
from cuda_ext import fixedrate
from service.load import pipeline
from service.model import build, compressed, fixed, llama

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU)")


def served(path, weights: str, device: str = "cpu") -> build.ServedModel:
    d = pipeline.decode_archive(path, torch.device(device), compressed=weights == "compressed", form="fixed")
    return build.finish(DEMO, build.prepare(DEMO, d.files), d.tensors, d.layers, torch.device(device),
                        blocks=d.blocks, fixed_form=d.fixed)


@pytest.fixture(scope="module")
def both_modes(dense_demo_archive):
    return served(dense_demo_archive, "decoded"), served(dense_demo_archive, "compressed")


def test_every_linear_holds_the_fixed_form(both_modes, dense_demo_archive) -> None:
    decoded, packed = both_modes
    m = packed.model
    assert packed.weights == "compressed" and packed.schedule is None
    linears = [x for x in m.modules() if isinstance(x, fixed.FixedLinear)]
    assert len(linears) == 7 * m.config.num_hidden_layers                # q k v o gate up down; the head is tied
    assert not any(type(x) is llama.Linear and x is not m.lm_head for x in m.modules())
    assert m.lm_head.weight is m.model.embed_tokens.weight                 # decoded back, tied as in decoded mode
    assert torch.equal(m.model.embed_tokens.weight, decoded.model.model.embed_tokens.weight)
    down, want = packed.model.model.layers[3].mlp.down_proj, decoded.model.model.layers[3].mlp.down_proj.weight
    assert torch.equal(fixedrate.decode(down.weight_form), want)          # bit-exact through the transcoder
    with Archive.open(dense_demo_archive) as archive:
        entries = archive.entries
    layer_bytes = sum(e.nbytes for e in entries if e.layer is not None and len(e.shape) == 2)
    held = sum(x.weight_form.nbytes for x in linears)
    assert 0.69 * layer_bytes < held < 0.72 * layer_bytes
    assert packed.weight_bytes == held + sum(t.nbytes for t in m.parameters())
    assert packed.weight_bytes <= compressed.estimate_bytes(entries, scratch=2, form="fixed") < 0.8 * decoded.weight_bytes


@pytest.mark.timeout(900)
def test_same_tokens_and_logits_as_decoded_mode(both_modes) -> None:
    """The 5 prompts x 32 tokens in one batch of 8. On the CPU the form is decoded exactly and
    multiplied as decoded mode multiplies, whatever the rows, so a batch of one would repeat this
    check at 5x its cost (47 s of the suite); the fused kernels, whose sums do depend on the
    rows, are checked at batch 1 and 8 on CUDA (below)."""
    assert_same_greedy(*both_modes, 8)


@pytest.mark.anyio
@CUDA
async def test_budget_of_0_8_bf16_serves_only_compressed_on_cuda(serve, dense_store) -> None:
    async with serve(dense_store, device="cuda") as server:
        c = server.client
        decoded_bytes = (await c.get(f"/models/{DEMO}")).json()["decoded_bytes"]
        in_use = torch.cuda.memory_allocated() if server.registry.device.type == "cuda" else 0   # other tests' models
        server.registry.settings.gpu_memory_budget = int(0.8 * decoded_bytes) + in_use
        r = await c.post(f"/models/{DEMO}/load", params={"weights": "decoded"})
        assert r.status_code == 507, r.text
        r = await c.post(f"/models/{DEMO}/load", params={"weights": "compressed"})
        assert r.status_code == 200 and r.json()["weight_bytes"] <= 0.8 * decoded_bytes, r.text
        model = server.registry.get(DEMO).served.model
        assert any(isinstance(x, fixed.FixedLinear) for x in model.modules())   # the default form on CUDA
        r = await c.post("/generate", json=generate_body())
        assert r.status_code == 200 and r.json()["generated_text"].startswith("The capital of France is Paris"), r.text
        assert (await c.post(f"/models/{DEMO}/unload")).status_code == 200


@pytest.mark.timeout(900)
@CUDA
@pytest.mark.parametrize("batch", [1, 8])
def test_same_tokens_as_decoded_mode_on_cuda(dense_demo_archive, batch) -> None:
    """The fused decode-matmul (1..16 rows) and decode + cuBLAS (prompts): decoded mode's greedy
    tokens up to each row's end of turn; the logits differ by float32 summation order, which parts
    a row that generates past its end of turn at a near-tie ("2 + 2 =": token 19 of 32, H100)."""
    assert_same_greedy(served(dense_demo_archive, "decoded", "cuda"), served(dense_demo_archive, "compressed", "cuda"),
                       batch, exact_logits=False, to_end_of_turn=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_fp16_matrices_stay_decoded(fp16_tiny_archive, untied_tiny_archive, caplog, device) -> None:
    """The form holds bf16 matrices only: on fp16 weights it is larger than fp16 (why, below), so
    an fp16 model's matrices stay decoded in this form, its estimate counts them (and its
    embedding table, which stays on the device) decoded, and the load says so."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 1024, generator=g) * 0.02 * torch.exp(0.35 * torch.randn(64, 1, generator=g))).half()
    assert fixedrate.encode(w).nbytes > 1.3 * w.nbytes                 # 65 % escaped
    with Archive.open(fp16_tiny_archive) as archive:
        entries = archive.entries
    matrices = [e for e in entries if e.layer is not None and len(e.shape) == 2 and e.codec == "float"]
    assert len(matrices) >= 10 and all(e.torch_dtype == torch.float16 for e in matrices)
    assert not any(fixed.keeps(e) for e in entries) and fixed.passed_over(entries) == matrices
    host = frozenset({fixed.EMBEDDING})                       # what host_names gives an untied model
    estimate = compressed.estimate_bytes(entries, scratch=2, form="fixed", host=host)
    assert estimate == sum(e.nbytes for e in entries)
    with Archive.open(untied_tiny_archive) as archive:        # bf16: the form and the host table count
        bf16 = archive.entries
    temporary = fixed.decode_unit_bytes([e for e in bf16 if fixed.keeps(e) and e.layer is not None])
    assert compressed.estimate_bytes(bf16, 2, "fixed", host) < compressed.estimate_bytes(bf16, 2, "fixed") \
        < sum(e.nbytes for e in bf16) + temporary             # the form under bf16's bytes, and a prompt step's temporary
    with caplog.at_level("WARNING", logger="wcodec.service"):
        packed = served(fp16_tiny_archive, "compressed", device)
    assert f"{len(matrices)} float16 matrices" in caplog.text and "stay decoded" in caplog.text
    decoded = served(fp16_tiny_archive, "decoded", device)
    assert not any(isinstance(x, (fixed.FixedLinear, fixed.HostEmbedding)) for x in packed.model.modules())
    assert packed.weight_bytes == decoded.weight_bytes == estimate
    want = decoded.model.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in packed.model.state_dict().items())


def test_joined_projections_are_views_of_one_form() -> None:
    """paged.fuse_projections on FixedLinears: one FixedLinear over the stacked forms, each part's
    arrays row views of it (no byte twice), the joined matmul giving each part's outputs."""
    from service.model import paged
    ws = [fixedrate.sample_weight(torch.bfloat16, rows, 96, seed=rows, finite=True) for rows in (64, 16, 16)]
    parent = torch.nn.Module()
    parts = tuple(fixed.FixedLinear(fixedrate.encode(w), None) for w in ws)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    alone = [p(x) for p in parts]
    paged._join(parent, "qkv", parts)
    joined = parent.qkv_linear
    assert joined.out_features == 96 and torch.equal(fixedrate.decode(joined.weight_form), torch.cat(ws))
    for p, w in zip(parts, ws):
        assert p.plane.untyped_storage().data_ptr() == joined.plane.untyped_storage().data_ptr()
        assert p.esc is joined.esc and torch.equal(fixedrate.decode(p.weight_form), w)
    for got, want in zip(paged._joined(parent, "qkv", parts, x), alone):
        torch.testing.assert_close(got, want, rtol=0.02, atol=1e-3)
    paged._join(parent, "qkv", parts)                                      # once
    assert parent.qkv_linear is joined


def test_parts_kept_decoded_are_not_joined() -> None:
    """A layer whose k or v matrix is kept decoded (raw-coded in a small model) beside FixedLinears:
    nothing joined, each part still computes alone (a load of such a model failed with an
    AttributeError on the plain Linear)."""
    from service.model import llama, paged
    w = fixedrate.sample_weight(torch.bfloat16, 32, 64, seed=1, finite=True)
    plain = llama.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    parts = (fixed.FixedLinear(fixedrate.encode(w), None), plain, fixed.FixedLinear(fixedrate.encode(w), None))
    parent = torch.nn.Module()
    paged._join(parent, "qkv", parts)
    assert not hasattr(parent, "qkv_linear") and not hasattr(parent, "qkv_weight")
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert [t.shape for t in paged._joined(parent, "qkv", parts, x)] == [(2, 32)] * 3


def test_a_host_embedding_gathers_the_tables_rows() -> None:
    """HostEmbedding on the CPU (the op's twin; on CUDA the table is page-locked and the GPU reads
    it: tests/service/engine/test_scheduler_cuda.py): F.embedding's rows, any ids' shape."""
    assert cuda_ext.available().cpp                         # its ops registered (the C++ twin builds in CI)
    table = torch.randn(50, 24, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    emb = fixed.HostEmbedding(table)
    ids = torch.tensor([[0, 49, 7], [7, 3, 3]])
    assert torch.equal(emb(ids), torch.nn.functional.embedding(ids, table))
    assert emb.embedding_dim == 24 and dict(emb.named_buffers()) == {"weight": table}
    assert emb.state_dict() == {}                           # not a checkpoint's tensor: the load assigns none


def test_without_cuda_the_embedding_stays_on_its_device(untied_tiny_archive) -> None:
    """The host table is a CUDA placement: on the CPU an untied embedding is decoded back as before."""
    packed = served(untied_tiny_archive, "compressed")
    assert type(packed.model.model.embed_tokens) is llama.Embedding and packed.host_bytes == 0
    assert isinstance(packed.model.lm_head, fixed.FixedLinear)


def test_the_estimate_leaves_out_a_table_kept_on_the_host(untied_tiny_archive, monkeypatch) -> None:
    """The memory budget's estimate before a CUDA load: an untied llama.py model's table is not
    counted on the device (its config, read from the archive, says so); a tied one, a model
    that is not llama.py's, or an extension without the gather op, keeps it counted."""
    from service.load.job import Loader
    from service.metrics import Metrics
    from service.settings import Settings
    from service.timeline import Timeline
    monkeypatch.setattr(fixed.ops, "has_ops", lambda names, device=None: True)
    with Archive.open(untied_tiny_archive) as archive:
        entries = archive.entries
    table = next(e.nbytes for e in entries if e.name == fixed.EMBEDDING)
    whole = compressed.estimate_bytes(entries, scratch=2, form="fixed")
    assert compressed.estimate_bytes(entries, 2, "fixed", frozenset({fixed.EMBEDDING})) == whole - table
    loader = Loader(Settings(demo=False, cpu_dtype="model"), Metrics(), torch.device("cpu"), Timeline())
    monkeypatch.setattr(loader, "_form", lambda: "fixed")
    monkeypatch.setattr(loader.settings, "compressed_scratch", 2)
    assert loader.estimate_bytes(untied_tiny_archive, "compressed") == whole - table
    untied = {"model_type": "llama", "tie_word_embeddings": False, "vocab_size": 32, "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    host_names = lambda d: fixed.host_names(llama.native_config(d))          # noqa: E731  (as estimate_bytes)
    assert host_names(untied) == {fixed.EMBEDDING}
    assert host_names({**untied, "tie_word_embeddings": True}) == host_names(None) == frozenset()
    assert host_names({**untied, "model_type": "gpt2"}) == frozenset()
    assert host_names({"model_type": "llama"}) == frozenset()                 # not valid: the load says why
    monkeypatch.setattr(fixed.ops, "has_ops", lambda names, device=None: False)
    assert host_names(untied) == frozenset()


def test_the_estimate_counts_a_transformers_models_matrices_decoded(untied_tiny_archive, monkeypatch) -> None:
    """FixedLinears and block modules are llama.py's: a model served by transformers' classes
    (a config llama.py does not serve) gets its matrices decoded back at the load (fixed.attach),
    and the estimate counts them decoded; it counted the fixed-rate form."""
    from service.load import job
    from service.load.job import Loader
    from service.metrics import Metrics
    from service.settings import Settings
    from service.timeline import Timeline
    with Archive.open(untied_tiny_archive) as archive:
        entries, config = archive.entries, job._config(archive)
    whole = sum(e.nbytes for e in entries)
    assert compressed.estimate_bytes(entries, 2, "fixed", native=False) == whole
    assert compressed.estimate_bytes(entries, 2, "fixed") != whole          # the form, and its temporary
    loader = Loader(Settings(demo=False, cpu_dtype="model"), Metrics(), torch.device("cpu"), Timeline())
    monkeypatch.setattr(loader, "_form", lambda: "fixed")
    monkeypatch.setattr(job, "_config", lambda archive: {**config, "hidden_act": "gelu"})
    assert loader.estimate_bytes(untied_tiny_archive, "compressed") == whole


@torch.inference_mode()
def test_the_estimate_holds_the_largest_matrix_a_prompt_step_decodes() -> None:
    """Over fused_limit() rows a FixedLinear decodes its whole form into a temporary, and the engine
    joins each layer's q, k, v and its gate, up (paged.fuse_projections): the load's estimate counts
    the largest temporary a prompt step makes (here gate and up, twice the largest tensor), as
    measured on the modules that step calls."""
    from types import SimpleNamespace
    from service.engine.runner import Chunk, Runner
    from service.model import paged
    config = llama.LlamaConfig.parse({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                                      "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2})
    torch.manual_seed(0)
    m = llama.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    kept = {n: p.detach().contiguous() for n, p in m.named_parameters() if ".layers." in n and p.dim() == 2}
    fixed.attach(m, {n: fixedrate.encode(w) for n, w in kept.items()})
    paged.fuse_projections(m)
    decoded = []
    for x in m.modules():
        if isinstance(x, fixed.FixedLinear):
            x.register_forward_pre_hook(lambda mod, args: decoded.append(mod.out_features * mod.in_features * 2))
    runner = Runner(m, paged.PagedCache(m.config, 16, 16, torch.bfloat16, torch.device("cpu")), max_rows=4,
                    max_blocks=4, graphs=False)
    runner.run([], [Chunk(list(range(1, fixedrate.fused_limit() + 9)), 0, [0, 1, 2])])
    assert len(decoded) == 4 * config.num_hidden_layers                       # qkv, o, gate_up, down
    entries = [SimpleNamespace(name=n, nbytes=w.nbytes) for n, w in kept.items()]
    assert fixed.decode_unit_bytes(entries) == max(decoded) == 2 * max(e.nbytes for e in entries)
