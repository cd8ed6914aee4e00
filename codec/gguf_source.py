"""GGUF checkpoints (architectures llama and qwen2) for the .wcodec encoder: tensors dequantized
one at a time through the memory-mapped `gguf.GGUFReader`, config and tokenizer (chat template
included) rebuilt through transformers' GGUF support.

Read me first -- the traps:
- GGUF lists dimensions fastest-first (ggml `ne`), i.e. reversed relative to torch: a q_proj of
  torch shape [out, in] is stored with `tensor.shape == [in, out]`. `dequantize` already returns the
  torch (row-major) layout; `TensorInfo.shape` is `reversed(tensor.shape)`.
- llama.cpp's converter permutes the rows of q and k of a llama file (its rope pairs adjacent dims,
  HF pairs halves); `_unpermute_rows` undoes it exactly as transformers' `LlamaTensorProcessor`
  does. A qwen2 file's rows are HF's (convert_hf_to_gguf.py's Qwen2Model permutes nothing):
  GGUF_ARCHITECTURES says which architecture is which. Its q/k/v biases are F32 tensors, dense.
- A GGUF without `output.weight` has a tied head: no `lm_head.weight` is listed and the generated
  config.json says `tie_word_embeddings: true`.
- Kept blocks (`keep_blocks`): `load_blocks` hands over a quantized tensor's blocks with the q/k
  row permutation undone on whole block rows (codec/gguf_blocks.py), so that they dequantize to
  exactly what `load` returns. Types the gguf codec has no row for come back None (stored dense).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from . import gguf_rope
from .errors import SourceError
from .gguf_blocks import BLOCK_TYPES, Blocks, shape_fits
from .checkpoint import CheckpointSource, TensorInfo

# The architectures served, each with whether llama.cpp permuted its q/k rows. Mistral's files say
# "llama"; Qwen2's and Qwen2.5's "qwen2" (q/k/v biases). Not qwen3 (q/k norms): llama.py has none.
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False}
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Not a parameter: the rope scaling that config.json says (gguf_rope.py), from which transformers
# and llama.py compute it again.
ROPE_FREQS = "rope_freqs.weight"
GGUF_DERIVED = frozenset({ROPE_FREQS})
# llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`) that split every number character off before
# GPT-2's split (llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA).
# transformers' GGUF reader knows none of them and splits as GPT-2 alone: "a  1" became a|Ġ|Ġ|1
# where the model was trained on a|ĠĠ|1, and "\n\n1." Ċ|Ċ|1 where it saw ĊĊ|1.
GGUF_DIGIT_PRE = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"})
# Pre-tokenizers of vocabularies whose own tokenizer NFC-normalizes text first (Qwen2's and
# Qwen2.5's tokenizer.json, transformers' Qwen2Tokenizer); transformers' GGUF reader gives the split
# but no normalizer: "cafe\u0301" became e|\u0301 where the model saw the one token "é".
GGUF_NFC_PRE = frozenset({"qwen2"})
# Tokens that end generation besides the file's eos, as llama.cpp's vocabulary loader marks them
# (llama-vocab.cpp: the file's eot and eom ids, and the special tokens of its end-of-generation
# texts): Llama-3-Instruct's <|eot_id|> where a conversion's eos is <|end_of_text|> (generation ran
# on past the turn's end), Qwen2.5-Instruct's <|endoftext|> beside its <|im_end|> (its own
# generation_config.json lists both), Gemma's <end_of_turn>.
GGUF_END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                          "<EOT>", "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>")
GGUF_NAME_RE = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<stem>\w+)\.(?P<suffix>weight|bias)")


class GGUFSource(CheckpointSource):
    """A GGUF file of an architecture GGUF_ARCHITECTURES lists, dequantized per tensor and renamed
    to HF names."""

    def __init__(self, path: Path, dtype: torch.dtype, keep_blocks: bool = False) -> None:
        super().__init__(path)
        self._dtype = dtype
        self._keep = keep_blocks
        self._files: dict[str, bytes] | None = None
        self._reader: gguf.GGUFReader | None = _gguf_reader(path)
        arch = self._field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise self._error(f"unsupported GGUF architecture {arch!r} (supported: {sorted(GGUF_ARCHITECTURES)})")
        self._permuted = GGUF_ARCHITECTURES[arch]
        self._n_head = int(self._field(f"{arch}.attention.head_count"))
        self._n_kv_head = int(self._field(f"{arch}.attention.head_count_kv", self._n_head))
        self._by_name: dict[str, gguf.ReaderTensor] = {}
        for tensor in self._reader.tensors:
            if tensor.name not in GGUF_DERIVED:
                self._by_name[self._hf_name(tensor.name)] = tensor
        self._tied = "lm_head.weight" not in self._by_name  # no output.weight: head shares token_embd
        self._rope = self._rope_scaling(arch)

    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.get_field(key) if self._reader is not None else None
        if field is None:
            if default is None:
                raise self._error(f"GGUF metadata lacks {key!r}")
            return default
        return field.contents()

    def _rope_scaling(self, arch: str) -> tuple | None:
        """The rope scaling config.json must say (sorted items; None: the default rope), which
        transformers' GGUF loader reads from neither place llama.cpp writes it: a linear one as
        `{arch}.rope.scaling.type` and `.factor`, Llama 3.1's as `rope_freqs.weight`. Another kind
        (yarn, longrope: parameters of llama.cpp's own) is refused, never served as the default rope."""
        kind = str(self._field(f"{arch}.rope.scaling.type", "none"))
        if kind not in ("none", "linear"):
            raise self._error(f"rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported (linear is, and "
                              f"{ROPE_FREQS}); served with the default rope, the model would be wrong")
        freqs = self._rope_freqs(arch)
        if kind == "none":
            return freqs
        if freqs is not None:
            raise self._error(f"both a linear rope scaling and {ROPE_FREQS}: "
                              "which one the model was trained with is unknown")
        factor = float(self._field(f"{arch}.rope.scaling.factor"))
        return (("factor", factor), ("rope_type", "linear")) if factor != 1.0 else None

    def _rope_freqs(self, arch: str) -> tuple | None:
        """The llama3 rope scaling that `rope_freqs.weight` holds (sorted items), None without one."""
        tensor = next((t for t in self._reader.tensors if t.name == ROPE_FREQS), None)
        if tensor is None:
            return None
        theta = float(self._field(f"{arch}.rope.freq_base", 10000.0))
        head_dim = int(self._field(f"{arch}.rope.dimension_count", 0)
                       or int(self._field(f"{arch}.embedding_length")) // self._n_head)
        try:
            scaling = gguf_rope.llama3_scaling(np.asarray(tensor.data, dtype=np.float32), theta, head_dim)
        except ValueError as exc:
            raise self._error(f"{ROPE_FREQS}: {exc}; served with the default rope, the model would be wrong") from None
        return tuple(sorted(scaling.items())) if scaling else None

    def _hf_name(self, gguf_name: str) -> str:
        match = GGUF_NAME_RE.fullmatch(gguf_name)
        if match is None:
            raise self._error(f"unknown GGUF tensor name {gguf_name!r}")
        layer, stem = match["layer"], match["stem"]
        hf_stem = (GGUF_BLOCK_NAMES if layer else GGUF_TOP_NAMES).get(stem)
        if hf_stem is None:
            raise self._error(f"unknown GGUF tensor name {gguf_name!r}")
        prefix = f"model.layers.{layer}." if layer else ""
        return f"{prefix}{hf_stem}.{match['suffix']}"

    @property
    def files(self) -> dict[str, bytes]:
        if self._files is None:
            pre = str(self._field("tokenizer.ggml.pre", ""))
            ids = (int(self._field(f"tokenizer.ggml.{k}_token_id", -1)) for k in ("eot", "eom"))
            ends = tuple(i for i in ids if i >= 0)
            given = _GIVEN_READER.set(self._reader)
            try:
                self._files = _gguf_side_files(self.path, tied=self._tied, rope=self._rope, pre=pre, ends=ends)
            finally:
                _GIVEN_READER.reset(given)
        return dict(self._files)

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(n, self._dtype, _torch_shape(t)) for n, t in self._by_name.items()]

    def _tensor(self, name: str) -> gguf.ReaderTensor:
        if self._reader is None:
            raise self._error("source is closed")
        tensor = self._by_name.get(name)
        if tensor is None:
            raise self._error(f"no tensor named {name!r}")
        return tensor

    def load_blocks(self, name: str) -> Blocks | None:
        tensor = self._tensor(name)
        bt = BLOCK_TYPES.get(tensor.tensor_type.name)
        if not self._keep or bt is None:
            return None
        shape = _torch_shape(tensor)
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1)
        if not shape_fits(bt, shape) or raw.size != np.prod(shape) // bt.block_size * bt.type_size:
            raise self._error(f"tensor {tensor.name!r}: {raw.size} bytes are not the {bt.name} blocks of {shape}")
        rows = raw.reshape(int(np.prod(shape[:-1])), -1)     # a row of weights is whole blocks
        n_head = self._rope_heads(name)
        if n_head is not None:
            if shape[0] % (2 * n_head):
                raise self._error(f"tensor {tensor.name!r}: {shape[0]} rows do not split into {n_head} heads")
            rows = _unpermute_rows(torch.from_numpy(rows.copy()), n_head).numpy()
        return Blocks(bt, np.ascontiguousarray(rows).reshape(-1, bt.type_size))

    def load(self, name: str) -> torch.Tensor:
        tensor = self._tensor(name)
        try:
            values = torch.from_numpy(_dequantize(tensor))
        except NotImplementedError as exc:
            raise self._error(f"tensor {tensor.name!r}: {exc}") from exc
        shape = _torch_shape(tensor)
        if values.numel() != int(np.prod(shape)):
            raise self._error(f"tensor {tensor.name!r} dequantized to {values.numel()} values, expected {shape}")
        values = values.reshape(shape)
        n_head = self._rope_heads(name)
        if n_head is not None:
            if shape[0] % (2 * n_head):
                raise self._error(f"tensor {tensor.name!r}: {shape[0]} rows do not split into {n_head} heads")
            values = _unpermute_rows(values, n_head)
        return values.to(self._dtype).contiguous()

    def _rope_heads(self, name: str) -> int | None:
        """Heads whose rows llama.cpp permuted: q uses n_head, k uses n_kv_head (as in transformers);
        None for every tensor of an architecture it did not permute."""
        if not self._permuted:
            return None
        if ".self_attn.q_proj." in name:
            return self._n_head
        if ".self_attn.k_proj." in name:
            return self._n_kv_head
        return None

    def close(self) -> None:
        self._reader = None
        self._by_name = {}


class _Reader(gguf.GGUFReader):
    """gguf-py's reader over a plain ndarray view of its memory map: each of the parse's million
    slices (a token, a merge: numpy views) skips numpy.memmap's Python-level __array_finalize__.
    The same fields and tensors, still read from the map; the demo's parse 2.4-3.0 -> 0.9-1.1 s
    (2-core EPYC, 2026-12-02)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def _gguf_reader(path: Path) -> gguf.GGUFReader:
    try:
        return _Reader(path, "r")
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise SourceError(path, f"not a readable GGUF file ({exc})") from exc


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32, torch row-major order
    return values if values.flags.writeable else values.copy()  # F32 comes back as a read-only mmap view


def _torch_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # ggml ne[] is fastest-first


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: GGUF rows run (head, i, pair), HF rows (head, pair, i)."""
    half = w.shape[0] // n_head // 2  # rope pairs per head
    # [H, half, 2, ...] -> [H, 2, half, ...]
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_side_files(path: Path, *, tied: bool, pre: str, rope: tuple | None = None,
                     ends: tuple[int, ...] = ()) -> dict[str, bytes]:
    """config.json, generation_config.json and tokenizer files, built by transformers from metadata.
    Once a process for a given file, through one parse of it (_one_parse; the source's own where
    it has one): the demo's conversion still takes 2.4 s on a 2-core CPU, and a process that
    converts one GGUF again (a second compress of it, the server's demo build beside one) reuses
    the result. The file's size, modification time and inode are part of the key, so a file
    replaced in place is converted anew. `pre`: the file's `tokenizer.ggml.pre` (_as_trained);
    `rope`: the llama3 scaling of the file's rope_freqs (sorted items), which transformers' loader
    does not read; `ends`: the file's eot and eom token ids (GGUF_END_OF_GENERATION)."""
    return dict(_side_files_of(*_file_key(path), tied, pre, rope, ends))


def _set_rope(config, scaling: dict) -> None:
    """The rope scaling into transformers' config: 5's rope_parameters (theta inside), or 4's rope_scaling."""
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {**config.rope_parameters, **scaling}
    else:
        config.rope_scaling = scaling


def _file_key(path: Path) -> tuple[Path, int, int, int]:
    """A file as the memo of its conversion knows it: resolved path, size, mtime (ns), inode."""
    st = path.stat()
    return path.resolve(), st.st_size, st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=4)
def _side_files_of(path: Path, size: int, mtime_ns: int, inode: int, tied: bool, pre: str,
                   rope: tuple | None, ends: tuple[int, ...]) -> dict[str, bytes]:
    from transformers import AutoConfig, AutoTokenizer

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    try:
        with _one_parse(path, _GIVEN_READER.get() or _gguf_reader(path)):
            config = AutoConfig.from_pretrained(path.parent, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    except (ValueError, OSError, KeyError) as exc:
        raise SourceError(path, f"transformers cannot build config/tokenizer ({exc})") from exc
    config.tie_word_embeddings = tied  # must match the tensors: no output.weight <=> tied head
    _as_trained(tokenizer, pre)
    if rope:
        _set_rope(config, dict(rope))
    files = {
        "config.json": config.to_json_string().encode(),
        "generation_config.json": _generation(config, tokenizer, ends).to_json_string().encode(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files.update({p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()})
    return files


# The reader of the file being converted, where its GGUFSource has one (`files`).
_GIVEN_READER: contextvars.ContextVar[gguf.GGUFReader | None] = contextvars.ContextVar("gguf_reader", default=None)
_PARSE_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_parse(path: Path, reader: gguf.GGUFReader):
    """Every `gguf.GGUFReader(path)` inside gets `reader`, already made. gguf-py's parse of the
    metadata makes a numpy view of every token and merge (3-5 s for the demo's 49 152 tokens on a
    2-core CPU), and transformers' loader parses the file again for the config and again for the
    tokenizer: the demo's side files took 15.7 s, 10.7 s of them in those two parses (2026-12-02).
    A reader of another file is made as before. One conversion at a time (the name is the module's)."""
    want = path.resolve()
    with _PARSE_LOCK:
        made = gguf.GGUFReader

        def shared(p, *args, **kwargs):
            return reader if Path(p).resolve() == want else made(p, *args, **kwargs)

        gguf.GGUFReader = shared
        try:
            yield
        finally:
            gguf.GGUFReader = made


def _generation(config: Any, tokenizer: Any, ends: tuple[int, ...]) -> Any:
    """The generation config of `config`, ending also on `ends` (the file's eot and eom ids) and on
    the special tokens of GGUF_END_OF_GENERATION's texts, the eos first."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids = [*ends, *(special[t] for t in GGUF_END_OF_GENERATION if t in special)]
    extra = list(dict.fromkeys(i for i in ids if i != config.eos_token_id))
    if extra and config.eos_token_id is not None:
        generation.eos_token_id = [config.eos_token_id, *extra]
    return generation


def _as_trained(tokenizer: Any, pre: str) -> None:
    """Text split and normalized as the vocabulary of pre-tokenizer `pre` was trained on, where
    transformers' reader does not: number characters split off one by one before the byte-level
    split (GGUF_DIGIT_PRE, as llama.cpp does), NFC first (GGUF_NFC_PRE, as the model's own tokenizer)."""
    from tokenizers import normalizers, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    if pre in GGUF_DIGIT_PRE and isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])
    if pre in GGUF_NFC_PRE and backend.normalizer is None:
        backend.normalizer = normalizers.NFC()
