"""A token's own bytes: what it adds to the UTF-8 text wherever it stands, a piece of a character
included, which decoding the token alone cannot give (`decode([id])` reads as U+FFFD there).
OpenAI's logprobs (`bytes`) and the grammar's vocabulary (engine/grammar.py) are made of them.

Read me first, the traps:
- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): every byte is written as one printable stand-in
  character ('Ġ' the space, 'Ċ' the newline); a piece maps back through that table, and a piece of
  a multi-byte character maps to bytes that are not UTF-8 on their own ('ĠðŁ' is b' \\xf0\\x9f').
- SentencePiece (Llama 2, Mistral): '▁' is the space; with byte fallback, a character outside the
  vocabulary is spelled a byte a token ('<0xE2>', '<0x82>', '<0xAC>' for '€'). Its decoder strips
  a text's leading space; a token's bytes keep it (the token's own, not its place in a text).
- an added token (special or not) is its content as written, never mapped through the table.
- other tokenizers (WordPiece, a slow tokenizer without `backend_tokenizer`): the token decoded
  alone, encoded (best effort: there a piece of a character is U+FFFD's bytes).

    decoder_steps(rust)             the types of the decoder's steps
    vocabulary_kind(rust)           BYTE_LEVEL, SENTENCEPIECE or None, read off those steps
    piece_bytes(piece, byte_level)  a vocabulary piece's bytes
    TokenBytes(tokenizer)           token id -> its bytes (ServedModel.token_bytes)
"""
from __future__ import annotations

import json
from functools import lru_cache

BYTE_LEVEL, SENTENCEPIECE = "byte_level", "sentencepiece"
SPACE = "\u2581"                                # SentencePiece's '▁'


@lru_cache(maxsize=1)
def byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in -> the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, moved = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + moved)] = b
            moved += 1
    return chars


def decoder_steps(rust) -> set[str]:
    """The types of a `tokenizers.Tokenizer`'s decoder and of its Sequence's steps (read from the
    decoder's own JSON, its pickled state: `rust.to_str()` took 0.4 s for the demo's vocabulary)."""
    decoder = json.loads(rust.decoder.__getstate__()) if rust.decoder is not None else {}
    return {t for t in [decoder.get("type"), *(d.get("type") for d in decoder.get("decoders", []))] if t}


def vocabulary_kind(rust) -> str | None:
    """BYTE_LEVEL where a ByteLevel step decodes; SENTENCEPIECE where '▁' or <0xNN> steps do; else None."""
    steps = decoder_steps(rust)
    if "ByteLevel" in steps:
        return BYTE_LEVEL
    return SENTENCEPIECE if steps & {"Metaspace", "ByteFallback", "Replace"} else None


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """A vocabulary piece's bytes. KeyError: a character outside the byte-level alphabet."""
    if byte_level:
        table = byte_chars()
        return bytes(table[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):    # SentencePiece's byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace(SPACE, " ").encode()


class TokenBytes:
    """`token_bytes(id)`: the bytes token `id` stands for, of a serving tokenizer (tokenizer.py's
    or transformers')."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._rust = getattr(tokenizer, "backend_tokenizer", None)
        self.kind = vocabulary_kind(self._rust) if self._rust is not None else None
        self._added = frozenset(self._rust.get_added_tokens_decoder()) if self.kind else frozenset()

    def __call__(self, token: int) -> bytes:
        piece = self._rust.id_to_token(token) if self.kind else None
        if piece is None:                       # another kind of tokenizer
            return self._tokenizer.decode([token], skip_special_tokens=False).encode()
        if token in self._added:
            return piece.encode()
        try:
            return piece_bytes(piece, self.kind == BYTE_LEVEL)
        except KeyError:                        # as the ByteLevel decoder does: such a piece as written
            return piece.encode()
