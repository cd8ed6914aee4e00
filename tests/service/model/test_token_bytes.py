"""A token's own bytes (service/model/token_bytes.py) of small vocabularies built here: GPT-2's
byte level, where BPE merges pieces of multi-byte characters; SentencePiece's byte fallback (with
the Replace decoder steps of Llama 2's tokenizer.json, and with a Metaspace step), where a
character outside the vocabulary is a token a byte. The tokens of a text, their bytes joined,
are the text's UTF-8, where decoding each alone gives U+FFFD for the pieces."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from service.model.token_bytes import BYTE_LEVEL, SENTENCEPIECE, TokenBytes
from service.model.tokenizer import Tokenizer as ServingTokenizer

TEXT = "café costs 5€, 日本語 🍕 naïve"
FALLBACK_TEXT = "café 日€"                      # 'é' in the vocabulary; '日' and '€' are not


def serving(rust: Tokenizer) -> ServingTokenizer:
    return ServingTokenizer(rust, {}, {}, None)


def byte_level() -> Tokenizer:
    """The byte alphabet, and merges as the demo's (SmolLM2) has them: 'æĹ' (b'\\xe6\\x97', two of
    '日''s three bytes), 'ĠðŁ' (b' \\xf0\\x9f', a space and half an emoji), 'Ã©' ('é' whole)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("\u00e6", "\u0139"), ("\u0120", "\u00f0"), ("\u0120\u00f0", "\u0141"), ("\u00c3", "\u00a9")]
    vocab = {c: i for i, c in enumerate([*alphabet, *("".join(m) for m in merges), "<|im_end|>"])}
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.add_special_tokens(["<|im_end|>"])
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return tok


def byte_fallback(metaspace: bool) -> Tokenizer:
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "c", "a", "f", "é", "\u2581c"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [("\u2581", "c")], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()])
    else:                                       # Llama 2's tokenizer.json
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return tok


def pieces_of_characters(rust: Tokenizer, ids: list[int], token_bytes: TokenBytes) -> list[int]:
    """The ids whose bytes are not UTF-8 alone; decoding each alone reads as U+FFFD."""
    partial = []
    for i in ids:
        try:
            token_bytes(i).decode()
        except UnicodeDecodeError:
            partial.append(i)
            assert "\ufffd" in rust.decode([i]), rust.id_to_token(i)
    return partial


def test_byte_level_tokens_spell_the_text_byte_for_byte() -> None:
    rust = byte_level()
    token_bytes = TokenBytes(serving(rust))
    ids = rust.encode(TEXT).ids
    assert token_bytes.kind == BYTE_LEVEL
    assert b"".join(token_bytes(i) for i in ids) == TEXT.encode()
    partial = pieces_of_characters(rust, ids, token_bytes)
    assert {token_bytes(i) for i in partial} >= {b"\xe6\x97", b" \xf0\x9f", b"\xa5"}
    assert token_bytes(rust.token_to_id("\u0120")) == b" " and token_bytes(rust.token_to_id("\u00e6")) == b"\xe6"
    assert token_bytes(rust.token_to_id("<|im_end|>")) == b"<|im_end|>"  # an added token: its content


@pytest.mark.parametrize("metaspace", [False, True], ids=["replace", "metaspace"])
def test_byte_fallback_tokens_are_their_byte(metaspace: bool) -> None:
    rust = byte_fallback(metaspace)
    token_bytes = TokenBytes(serving(rust))
    ids = rust.encode(FALLBACK_TEXT).ids
    assert token_bytes.kind == SENTENCEPIECE
    assert [rust.id_to_token(i) for i in ids][-6:] == ["<0xE6>", "<0x97>", "<0xA5>", "<0xE2>", "<0x82>", "<0xAC>"]
    assert b"".join(token_bytes(i) for i in ids) == b" " + FALLBACK_TEXT.encode()   # '▁' before the first
    assert len(pieces_of_characters(rust, ids, token_bytes)) == 6
    assert token_bytes(rust.token_to_id("\u2581c")) == b" c" and token_bytes(rust.token_to_id("é")) == "é".encode()


def test_other_tokenizers_fall_back_to_decoding_alone() -> None:
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "caf": 1, "##é": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    token_bytes = TokenBytes(serving(tok))
    assert token_bytes.kind is None and [token_bytes(i) for i in (1, 2)] == [tok.decode([i]).encode() for i in (1, 2)]


def test_a_byte_level_piece_outside_the_alphabet_is_as_written() -> None:
    rust = Tokenizer(models.BPE({"a": 0, "日a": 1}, []))
    rust.decoder = decoders.ByteLevel()
    assert TokenBytes(serving(rust))(1) == "日a".encode() == rust.decode([1]).encode()
