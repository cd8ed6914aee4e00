"""GGUF files of the qwen2 architecture (Qwen2, Qwen2.5) as a checkpoint source: a tiny random
Qwen2 written as llama.cpp writes them (tests/tiny_gguf.py: Q4_K / Q8_0 blocks, F32 q/k/v biases,
rows in HF's order, a `gpt2` vocabulary with pre-tokenizer "qwen2", padded with [PADn]). Its
tensors, config and tokenizer must be the HF model's; other architectures (qwen3, phi3) are
refused in one line that names the supported ones."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from codec import gguf_blocks
from codec.sources import SourceError, open_source
from tests.tiny_gguf import (SIZES, dequantized_state, gguf_name, qwen2_tokenizer, random_qwen2,
                             write_qwen2_gguf)

VOCAB = 416
# digits, contractions (any case), CJK, runs of newlines and spaces, a decomposed accent (NFC), specials
TEXTS = ("In 2024, 12345 cats", "don't I'LL   they're", "日本語のテキスト 東京",
         "Steps:\n\n1. one\r\n  2. two", "  \n\n\t x", "cafe\u0301 ｆｕｌｌ ①", "<|im_start|>user\nhi<|im_end|>\n", "")


@pytest.fixture(scope="module")
def tok():
    return qwen2_tokenizer()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen2(request, tok, tmp_path_factory: pytest.TempPathFactory):
    """(the GGUF's path, the HF model it was written from)."""
    model = random_qwen2(VOCAB, tied=request.param)
    return write_qwen2_gguf(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2.gguf", model, tok), model


@pytest.fixture(scope="module")
def files(qwen2) -> dict[str, bytes]:
    with open_source(qwen2[0]) as src:
        return src.files


def test_names_shapes_and_values_are_the_hf_models(qwen2) -> None:
    """No q/k row permutation to undo (a llama file's undone here scrambles q and k by whole rows),
    biases as stored (F32), every tensor what gguf dequantizes."""
    path, model = qwen2
    tied = model.config.tie_word_embeddings
    theirs = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not tied}
    by_gguf = dequantized_state(path)
    with open_source(path, gguf_dtype=torch.float32) as src:
        assert {i.name: i.shape for i in src.tensors()} == {k: tuple(v.shape) for k, v in theirs.items()}
        for name, ref in theirs.items():
            ours = src.load(name)
            assert torch.equal(ours, by_gguf[gguf_name(name)]), name
            step = ref.abs().max() / 7 if ref.dim() == 2 else 0          # within one Q4_K step at most
            assert (ours - ref).abs().max() <= step, name
        assert src.load("model.layers.1.self_attn.k_proj.bias").dtype == torch.float32


def test_blocks_are_kept_and_dequantize_to_what_load_gives(qwen2) -> None:
    with open_source(qwen2[0], gguf_dtype=torch.float32, gguf_keep=True) as src:
        kept = {i.name: src.load_blocks(i.name) for i in src.tensors()}
        assert kept["model.layers.0.self_attn.q_proj.weight"].block.name == "Q4_K"
        assert kept["model.layers.0.self_attn.v_proj.weight"].block.name == "Q8_0"
        assert all(v is None for k, v in kept.items() if k.endswith("bias") or "norm" in k)
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
            blocks, shape = kept[name], tuple(src.load(name).shape)
            assert torch.equal(gguf_blocks.dequantize(blocks.block, blocks.data, shape, torch.float32), src.load(name))


def test_config_is_qwen2s(qwen2, tok, files) -> None:
    from transformers import AutoConfig

    model = qwen2[1]
    config = json.loads(files["config.json"])
    assert config["model_type"] == "qwen2"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert config[key] == getattr(model.config, key), key
    assert config["rms_norm_eps"] == float(np.float32(SIZES["rms_norm_eps"]))          # GGUF stores a float32
    assert config["use_sliding_window"] is False and config["sliding_window"] is None
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == tuple(
        tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|endoftext|>"))
    # Qwen2.5-Instruct's generation_config.json; llama.cpp ends generation on both (its EOG texts)
    eos = json.loads(files["generation_config.json"])["eos_token_id"]
    assert eos == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert AutoConfig.for_model(**config).rope_parameters["rope_theta"] == SIZES["rope_theta"]


def test_generation_also_ends_on_the_files_eot_token(tok, tmp_path: Path) -> None:
    """llama.cpp ends generation on the file's eot (and eom) id too, whatever its text."""
    path = write_qwen2_gguf(tmp_path / "eot.gguf", random_qwen2(VOCAB, tied=True), tok, eot="<|im_start|>")
    with open_source(path) as src:
        eos = json.loads(src.files["generation_config.json"])["eos_token_id"]
    assert eos == [tok.token_to_id(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")]


def test_tokenizer_splits_and_normalizes_as_qwen2s(tok, files, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    for text in TEXTS:
        assert ours.encode(text).ids == tok.encode(text).ids, text
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.encode("<|im_end|>") == [tok.token_to_id("<|im_end|>")] and hf.eos_token == "<|im_end|>"
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_other_architectures_are_refused_naming_the_supported(tok, tmp_path: Path, arch: str, capsys) -> None:
    """qwen3 (q/k norms, which llama.py has not) and phi3: one typed error, one line from the CLI."""
    from wcodec import cli

    path = write_qwen2_gguf(tmp_path / f"{arch}.gguf", random_qwen2(VOCAB, tied=True), tok, arch=arch)
    message = f"{path}: unsupported GGUF architecture {arch!r} (supported: ['llama', 'qwen2'])"
    with pytest.raises(SourceError) as err:
        open_source(path)
    assert str(err.value) == message
    assert cli.main(["compress", str(path), str(tmp_path / "out.wcodec")]) == 1
    assert capsys.readouterr().err == f"wcodec: error: {message}\n"
    assert not (tmp_path / "out.wcodec").exists()
