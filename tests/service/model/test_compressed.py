"""Compressed-resident mode on the CPU (C++ twin), with the real demo model float-coded (its GGUF
blocks dequantized to bf16: `--gguf dense`): the same tokens and bit-identical logits as decoded
mode, a memory budget that only the compressed mode fits, and the mode and bytes in GET /models and
/metrics. The default demo archive keeps GGUF blocks, which compressed mode keeps as blocks
(test_quantized.py)."""
from __future__ import annotations

import pytest
import torch
from service_helpers import DEMO, generate_body

from codec.constants import SEGMENT_STEPS
from service.load import pipeline
from service.model import build, llama, paged
from service.model import compressed

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.", "2 + 2 =",
           "List three primary colors:", "Translate 'good morning' to French:"]


def served(path, compressed: bool, device: str = "cpu") -> build.ServedModel:
    decoded = pipeline.decode_archive(path, torch.device(device), compressed=compressed)
    ready = build.prepare(DEMO, decoded.files)
    return build.finish(DEMO, ready, decoded.tensors, decoded.layers, torch.device(device))


def encode(model: build.ServedModel, prompts: list[str]) -> list[list[int]]:
    tok = model.tokenizer
    return [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False))
            ["input_ids"] for p in prompts]


def greedy(model: build.ServedModel, enc: list[list[int]], steps: int = 32):
    """Greedy tokens and every step's logits for a left-padded batch, with a KV cache."""
    width, device = max(len(e) for e in enc), next(model.model.parameters()).device
    ids = torch.tensor([[model.pad_id] * (width - len(e)) + e for e in enc], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=device)
    cache, tokens, logits = None, [], []
    with torch.inference_mode():
        for _ in range(steps):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                              use_cache=True, logits_to_keep=1)
            step, cache = out.logits[:, -1].float(), out.past_key_values
            logits.append(step)
            ids = step.argmax(-1, keepdim=True)
            tokens.append(ids[:, 0])
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@pytest.fixture(scope="module")
def both_modes(dense_demo_archive):
    return served(dense_demo_archive, compressed=False), served(dense_demo_archive, compressed=True)


def test_compressed_mode_keeps_layers_compressed(both_modes) -> None:
    decoded, packed = both_modes
    schedule = packed.schedule
    assert decoded.schedule is None and decoded.weights == "decoded"
    assert packed.weights == "compressed" and len(schedule.layers) == packed.model.config.num_hidden_layers
    assert len(schedule.scratch) == 1                                      # the CPU decodes in place
    assert len(schedule.units) == 7 * len(schedule.layers)                  # q k v o gate up down
    # the demo's tied 49152 x 576 embedding (21 % of its weights) stays decoded; its layers are ~0.67
    layer_bytes = sum(e.nbytes for c in schedule.layers for e in c.float_entries)
    assert schedule.compressed_bytes < 0.69 * layer_bytes
    assert packed.weight_bytes < 0.8 * decoded.weight_bytes, (packed.weight_bytes, decoded.weight_bytes)


def assert_same_greedy(decoded, packed, batch: int, steps: int = 32, prompts=PROMPTS, exact_logits: bool = True,
                       to_end_of_turn: bool = False) -> None:
    """The same greedy tokens and (`exact_logits`) bit-identical logits, prompt by prompt (batch 1)
    or in one batch. `to_end_of_turn`: each row's tokens up to its first end-of-sequence token (what
    a server sends; after it a model that goes on generating meets near-ties)."""
    groups = [[p] for p in prompts] if batch == 1 else [(list(prompts) * batch)[:batch]]
    for group in groups:
        enc = encode(decoded, group)
        t_dec, l_dec = greedy(decoded, enc, steps)
        t_cmp, l_cmp = greedy(packed, enc, steps)
        for a, b in zip(t_dec.tolist(), t_cmp.tolist()):
            stop = next((i + 1 for i, t in enumerate(a) if t in decoded.eos_ids), len(a)) if to_end_of_turn else len(a)
            assert a[:stop] == b[:stop], group
        assert torch.equal(l_dec, l_cmp) or not exact_logits, group


@pytest.mark.timeout(1800)
def test_same_tokens_and_bit_identical_logits(both_modes) -> None:
    """The 5 prompts x 32 tokens in one batch of 8. On the CPU each module is decoded into its
    buffer and multiplied by decoded mode's own Linear, whatever the rows, so a batch of one would
    repeat this check (48 s of the suite on this CPU); CUDA checks batch 1 and 8 (below)."""
    assert_same_greedy(*both_modes, 8)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_forward_that_raises_fails_that_step_alone(dense_demo_archive, device) -> None:
    """A module that raises between its hooks kept its scratch buffer (on CUDA, the unit after it
    one more, decoded ahead), and every later forward failed ("pop from empty list") until the
    model was reloaded; now the next one is whole."""
    model = served(dense_demo_archive, compressed=True, device=device)
    enc = encode(model, PROMPTS[:1])
    want, _ = greedy(model, enc, steps=4)
    proj = model.model.model.layers[3].mlp.gate_proj      # a unit: its hooks take and give back scratch
    real = type(proj).forward

    def once(self, *args, **kwargs):
        proj.forward = real.__get__(proj)                 # only this call fails
        raise MemoryError("simulated")
    proj.forward = once.__get__(proj)
    with pytest.raises(MemoryError):
        greedy(model, enc, steps=1)
    got, _ = greedy(model, enc, steps=4)
    assert torch.equal(got, want)


def test_a_qwen3_compressed_gives_decoded_modes_tokens_and_logits(qwen3_tiny_archive) -> None:
    """A tiny Qwen3 served by llama.py in compressed mode: its 7 matrices a layer kept compressed,
    q_norm and k_norm (1-D) decoded as the other norms; the same greedy tokens and bit-identical
    logits as decoded mode, in the padded forward and in the paged engine's step (a prompt's
    chunk, then decode rows)."""
    from service.engine.runner import Chunk, Decode, Runner
    decoded, packed = served(qwen3_tiny_archive, False), served(qwen3_tiny_archive, True)
    assert isinstance(packed.model, llama.LlamaForCausalLM) and packed.model.config.qk_norm
    assert packed.weights == "compressed" and len(packed.schedule.units) == 7 * 2
    assert not any("norm" in e.name for c in packed.schedule.layers for e in c.float_entries)
    assert_same_greedy(decoded, packed, batch=2, steps=8, prompts=PROMPTS[:2])
    runs = []
    for model in (decoded, packed):
        prompt, table = encode(model, PROMPTS[:1])[0], [0, 1, 2]
        cache = paged.PagedCache(model.model.config, 4, 16, model.dtype, torch.device("cpu"))
        runner, logits = Runner(model.model, cache, 4, 4, False, None), []
        with torch.inference_mode():
            logits.append(runner.run([], [Chunk(prompt, 0, table)])[0])
            for i in range(6):
                logits.append(runner.run([Decode(int(logits[-1].argmax()), len(prompt) + i, table)], [])[0])
        runs.append(torch.stack(logits))
    assert torch.equal(*runs)


def test_piece_size_per_module(both_modes, dense_demo_archive, monkeypatch) -> None:
    """Tensors of compressed.LARGE weights or more get 512-step pieces (half the index); a module of
    under a quarter of the largest module's weights 64 (the demo's k and v, 192 x 576 against the
    MLP's 1536 x 576: GQA's, as in an 8B model); the rest 256. A module's tensors share one piece
    size, and decoding is unchanged."""
    monkeypatch.setattr(compressed, "LARGE", 1 << 19)     # the demo's MLP matrices; not q, o (576 x 576)
    coarse = served(dense_demo_archive, compressed=True)
    parts = [part for c in coarse.schedule.layers for part in c.parts]
    want = {"k_proj": compressed.SMALL_ENTRY_STEPS, "v_proj": compressed.SMALL_ENTRY_STEPS,
            "q_proj": compressed.ENTRY_STEPS, "o_proj": compressed.ENTRY_STEPS, "gate_proj": compressed.LARGE_ENTRY_STEPS,
            "up_proj": compressed.LARGE_ENTRY_STEPS, "down_proj": compressed.LARGE_ENTRY_STEPS}
    for part in parts:
        steps = part.index.entry_steps
        assert all(want[e.name.split(".")[-2]] == steps for e in part.plan.float_entries), steps
        pieces = sum(e.params.n_segments for e in part.plan.float_entries) * (SEGMENT_STEPS // steps)
        assert part.index.words.numel() == pieces and part.index.states.numel() == 32 * pieces
    assert coarse.schedule.compressed_bytes < both_modes[1].schedule.compressed_bytes
    assert_same_greedy(both_modes[0], coarse, batch=2, steps=8, prompts=PROMPTS[:2])


@pytest.mark.timeout(900)
@CUDA
@pytest.mark.parametrize("batch", [1, 8])
def test_same_tokens_and_bit_identical_logits_on_cuda(dense_demo_archive, batch) -> None:
    """The demo on a GPU: compressed mode decodes each module on a side stream into a ring of two
    scratch buffers, and gives decoded mode's tokens and logits bit for bit."""
    decoded, packed = served(dense_demo_archive, False, "cuda"), served(dense_demo_archive, True, "cuda")
    assert packed.weights == "compressed" and len(packed.schedule.scratch) == 2
    assert_same_greedy(decoded, packed, batch)


@pytest.mark.anyio
async def test_budget_fits_only_compressed(serve, dense_store) -> None:
    async with serve(dense_store) as server:
        c = server.client
        decoded_bytes = (await c.get(f"/models/{DEMO}")).json()["decoded_bytes"]
        server.registry.settings.gpu_memory_budget = int(0.85 * decoded_bytes)
        r = await c.post(f"/models/{DEMO}/load", params={"weights": "decoded"})
        assert r.status_code == 507, r.text
        assert r.json()["error_type"] == "insufficient_memory"
        r = await c.post(f"/models/{DEMO}/load", params={"weights": "compressed"})
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["weights"] == "compressed" and 0 < info["weight_bytes"] <= 0.85 * decoded_bytes
        assert (info["resident"], info["resident_bytes"]) == (info["weights"], info["weight_bytes"])   # old names
        r = await c.post("/generate", json=generate_body())
        assert r.status_code == 200 and r.json()["generated_text"].startswith("The capital of France is Paris"), r.text
        listed = (await c.get("/models")).json()["models"][0]
        assert listed["weights"] == "compressed" and listed["weight_bytes"] == info["weight_bytes"]
        assert info["host_weight_bytes"] == listed["host_weight_bytes"] == 0               # GGUF blocks: none on the host
        # the metrics count what is held, as /models does: where bf16 is not native to this CPU,
        # the mixed matmul's float32 scratch too (a block of rows of the decoded tied head)
        held = info["weight_bytes"]
        assert await server.metric("wcodec_model_weight_bytes", model=DEMO, weights="compressed") == held
        assert await server.metric("wcodec_model_resident_bytes", model=DEMO, mode="compressed") == held
        assert await server.metric("wcodec_model_host_weight_bytes", model=DEMO) == 0      # GGUF blocks: none on the host
        assert await server.metric("wcodec_forward_decode_duration_seconds_count", model=DEMO, weights="compressed") > 0
        r = await c.post(f"/models/{DEMO}/unload")
        assert r.status_code == 200 and r.json()["weights"] is None and r.json()["host_weight_bytes"] is None
        assert await server.metric("wcodec_model_weight_bytes", model=DEMO, weights="compressed") == 0


@pytest.mark.anyio
@pytest.mark.parametrize("param", ["weights", "resident"])
async def test_unknown_weights_mode_is_422(serve, store, param) -> None:
    async with serve(store()) as server:
        r = await server.client.post(f"/models/{DEMO}/load", params={param: "halfway"})
        assert r.status_code == 422, r.text
        assert "error" in r.json() and r.json()["error_type"] == "validation"


@pytest.mark.anyio
async def test_the_old_query_name_still_chooses_the_mode(serve, dense_store) -> None:
    """`?resident=` is the old spelling of `?weights=`, kept for one release."""
    async with serve(dense_store) as server:
        r = await server.client.post(f"/models/{DEMO}/load", params={"resident": "compressed"})
        assert r.status_code == 200 and r.json()["weights"] == "compressed", r.text
