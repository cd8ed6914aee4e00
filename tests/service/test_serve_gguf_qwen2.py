"""A Qwen2 GGUF (arch "qwen2", as llama.cpp writes Qwen2.5's: Q4_K and Q8_0 blocks, F32 q/k/v
biases, no q/k permutation; tests/tiny_gguf.py) compressed by `wcodec compress` with its blocks
kept, served, and answering what transformers' Qwen2ForCausalLM answers on the weights the `gguf`
package dequantizes from that file: the same greedy tokens, each token's logprob within 1e-4
(fp32 on the CPU), in both weights modes (decoded; compressed: the blocks stay quantized)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codec.constants import CODEC_GGUF
from codec.decode import Archive
from service.model import llama, quantized
from tests.tiny_gguf import qwen2_tokenizer, random_qwen2, reference_model, write_qwen2_gguf
from wcodec import cli

pytestmark = pytest.mark.anyio
NEW = 12
PROMPT = ("<|im_start|>user\nWhat is the capital of France, cafe\u0301? I'll say 2024.<|im_end|>\n"
          "<|im_start|>assistant\n")                          # a decomposed é: Qwen2's tokenizer's NFC


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    """(a store holding the tiny Qwen2 GGUF's archive as "qwen", transformers' reference model, the tokenizer)."""
    folder = tmp_path_factory.mktemp("qwen2-gguf")
    tok = qwen2_tokenizer()
    model = random_qwen2(416, tied=False)                 # 340 tokens, padded as Qwen2.5's 151665 are to 152064
    path = write_qwen2_gguf(folder / "tiny-qwen2.gguf", model, tok)
    (folder / "store").mkdir()
    archive = folder / "store" / "qwen.wcodec"
    assert cli.main(["compress", str(path), str(archive), "--gguf-dtype", "float32", "--workers", "1"]) == 0
    return folder / "store", reference_model(path, model), tok


@torch.inference_mode()
def their_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, logprobs = torch.tensor([prompt]), []
    for _ in range(NEW):
        scores = model(input_ids=ids).logits[0, -1].log_softmax(-1)
        ids = torch.cat([ids, scores.argmax().view(1, 1)], 1)
        logprobs.append(scores.max().item())
    return ids[0, len(prompt):].tolist(), logprobs


def test_the_archive_keeps_the_blocks_and_the_biases_dense(qwen2) -> None:
    with Archive.open(qwen2[0] / "qwen.wcodec") as archive:
        codecs = {e.name: e.codec for e in archive.entries}
    assert codecs["model.layers.0.self_attn.q_proj.weight"] == CODEC_GGUF            # Q4_K
    assert codecs["model.layers.1.self_attn.v_proj.weight"] == CODEC_GGUF            # Q8_0
    for name in ("q_proj", "k_proj", "v_proj"):
        assert codecs[f"model.layers.1.self_attn.{name}.bias"] != CODEC_GGUF          # F32 in the file


@pytest.mark.parametrize("weights", ["decoded", "compressed"])
async def test_a_qwen2_gguf_is_served_as_transformers_computes_it(serve, qwen2, weights: str) -> None:
    store, reference, tok = qwen2
    prompt = tok.encode(PROMPT).ids
    tokens, logprobs = their_greedy(reference, prompt)
    async with serve(store, weights=weights) as server:
        r = await server.client.post("/models/qwen/load")
        assert r.status_code == 200 and r.json()["weights"] == weights, r.text
        served = server.registry.get("qwen").served
        assert isinstance(served.model, llama.LlamaForCausalLM)                   # the native engine, not transformers'
        assert served.eos_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
        kept = [m for m in served.model.modules() if isinstance(m, quantized.BlockLinear)]
        assert len(kept) == (15 if weights == "compressed" else 0)                # 7 a layer and the head: blocks
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "details": True, "decoder_input_details": True}}
        r = await server.client.post("/generate", json={**body, "model": "qwen"})
        assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert [t["id"] for t in details["prefill"]] == prompt                          # Qwen2's split, its specials whole
    assert [t["id"] for t in details["tokens"]] == tokens
    assert [t["logprob"] for t in details["tokens"]] == pytest.approx(logprobs, abs=1e-4)
