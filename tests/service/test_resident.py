"""Compressed-resident mode on the CPU (C++ twin), with the real demo model float-coded (its GGUF
blocks dequantized to bf16: `--gguf dense`): the same tokens and bit-identical logits as decoded
mode, a memory budget that only the compressed mode fits, and the mode and bytes in GET /models and
/metrics. The default demo archive keeps GGUF blocks, which compressed mode decodes at load."""
from __future__ import annotations

import pytest
import torch
from service_helpers import DEMO, generate_body

from service import loader, modeling, resident

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.", "2 + 2 =",
           "List three primary colors:", "Translate 'good morning' to French:"]


def served(path, compressed: bool) -> modeling.ServedModel:
    decoded = loader.decode_archive(path, torch.device("cpu"), compressed=compressed)
    ready = modeling.prepare(DEMO, decoded.files)
    return modeling.finish(DEMO, ready, decoded, torch.device("cpu"))


def encode(model: modeling.ServedModel, prompts: list[str]) -> list[list[int]]:
    tok = model.tokenizer
    return [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False))
            ["input_ids"] for p in prompts]


def greedy(model: modeling.ServedModel, enc: list[list[int]], steps: int = 32):
    """Greedy tokens and every step's logits for a left-padded batch, with a KV cache."""
    width = max(len(e) for e in enc)
    ids = torch.tensor([[model.pad_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
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


def test_gguf_blocks_stay_decoded_in_compressed_mode(demo_archive) -> None:
    """Only float-coded layers stay compressed: an archive of GGUF blocks loads in compressed mode
    exactly as in decoded mode (no layer kept, no schedule, the same tensors), and the memory
    estimate is the decoded bytes."""
    from codec.decode import Archive

    with Archive.open(demo_archive) as archive:
        entries = archive.entries
    layer_codecs = {e.codec for e in entries if e.layer is not None}
    assert "gguf" in layer_codecs and not any(resident.stays_compressed(e) for e in entries), layer_codecs
    plain = loader.decode_archive(demo_archive, torch.device("cpu"))
    kept = loader.decode_archive(demo_archive, torch.device("cpu"), compressed=True)
    assert kept.layers == [] and kept.tensors.keys() == plain.tensors.keys()
    assert all(torch.equal(kept.tensors[k], plain.tensors[k]) for k in plain.tensors)
    decoded_bytes = sum(e.nbytes for e in entries)
    assert resident.estimate_bytes(entries, slots=2) == decoded_bytes
    model = modeling.finish(DEMO, modeling.prepare(DEMO, kept.files), kept, torch.device("cpu"))
    assert model.resident == "decoded" and model.schedule is None


def test_compressed_mode_keeps_layers_compressed(both_modes) -> None:
    decoded, compressed = both_modes
    schedule = compressed.schedule
    assert decoded.schedule is None and decoded.resident == "decoded"
    assert compressed.resident == "compressed" and len(schedule.layers) == compressed.model.config.num_hidden_layers
    assert len(schedule.slots) == 1                                        # the CPU decodes in place
    assert len(schedule.units) == 7 * len(schedule.layers)                  # q k v o gate up down
    # the demo's tied 49152 x 576 embedding (21 % of its weights) stays decoded; its layers are ~0.67
    layer_bytes = sum(e.nbytes for c in schedule.layers for e in c.plan.float_entries)
    assert schedule.compressed_bytes < 0.69 * layer_bytes
    assert compressed.weight_bytes < 0.8 * decoded.weight_bytes, (compressed.weight_bytes, decoded.weight_bytes)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("batch", [1, 8])
def test_same_tokens_and_bit_identical_logits(both_modes, batch) -> None:
    decoded, compressed = both_modes
    groups = [[p] for p in PROMPTS] if batch == 1 else [(PROMPTS * 2)[:8]]
    for prompts in groups:
        enc = encode(decoded, prompts)
        t_dec, l_dec = greedy(decoded, enc)
        t_cmp, l_cmp = greedy(compressed, enc)
        assert torch.equal(t_dec, t_cmp), prompts
        assert torch.equal(l_dec, l_cmp), prompts


@pytest.mark.anyio
async def test_budget_fits_only_compressed(serve, dense_store) -> None:
    async with serve(dense_store) as server:
        c = server.client
        decoded_bytes = (await c.get(f"/models/{DEMO}")).json()["decoded_bytes"]
        server.registry.settings.gpu_memory_budget = int(0.85 * decoded_bytes)
        r = await c.post(f"/models/{DEMO}/load", params={"resident": "decoded"})
        assert r.status_code == 507, r.text
        assert r.json()["error_type"] == "insufficient_memory"
        r = await c.post(f"/models/{DEMO}/load", params={"resident": "compressed"})
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["resident"] == "compressed" and 0 < info["resident_bytes"] <= 0.85 * decoded_bytes
        r = await c.post("/generate", json=generate_body())
        assert r.status_code == 200 and r.json()["generated_text"].startswith("The capital of France is Paris"), r.text
        listed = (await c.get("/models")).json()["models"][0]
        assert listed["resident"] == "compressed" and listed["resident_bytes"] == info["resident_bytes"]
        assert await server.metric("wcodec_model_resident_bytes", model=DEMO, mode="compressed") == info["resident_bytes"]
        assert await server.metric("wcodec_forward_decode_duration_seconds_count", model=DEMO, mode="compressed") > 0
        r = await c.post(f"/models/{DEMO}/unload")
        assert r.status_code == 200 and r.json()["resident"] is None


@pytest.mark.anyio
async def test_unknown_resident_mode_is_422(serve, store) -> None:
    async with serve(store()) as server:
        r = await server.client.post(f"/models/{DEMO}/load", params={"resident": "halfway"})
        assert r.status_code == 422, r.text
        assert "error" in r.json() and r.json()["error_type"] == "validation"
