"""Streaming readers of model checkpoints for the .wcodec encoder.

Read me first -- the traps:
- Nothing here unpickles. `.bin`/`.pt`/`.pth`/`.ckpt`/`.pkl` (and files that look like pickles or
  torch zip archives) are refused: loading them can run arbitrary code.
- Tensors are read one at a time through memory maps (`safe_open`, `GGUFReader`); `tensors()` reads
  only headers, `load(name)` materializes one tensor.
- GGUF lists dimensions fastest-first (ggml `ne`), i.e. reversed relative to torch: a q_proj of
  torch shape [out, in] is stored with `tensor.shape == [in, out]`. `dequantize` already returns the
  torch (row-major) layout; `TensorInfo.shape` is `reversed(tensor.shape)`.
- llama.cpp's converter permutes the rows of q and k (its rope pairs adjacent dims, HF pairs halves);
  `_unpermute_rows` undoes it exactly as transformers' `LlamaTensorProcessor` does.
- A GGUF without `output.weight` has a tied head: no `lm_head.weight` is listed and the generated
  config.json says `tie_word_embeddings: true`.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from .errors import SourceError

SIDE_FILES = (  # embedded beside the weights; sentence-transformers side files are not needed
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.txt", "merges.txt", "vocab.json", "tokenizer.model",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

GGUF_MAGIC = b"GGUF"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save archives
PICKLE_PROTO = 0x80  # first byte of a pickle of protocol >= 2

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

GGUF_ARCHITECTURES = frozenset({"llama"})
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
# Precomputed from the rope scaling that transformers rebuilds from config.json; not a parameter.
GGUF_DERIVED = frozenset({"rope_freqs.weight"})
GGUF_NAME_RE = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<stem>\w+)\.(?P<suffix>weight|bias)")

LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")
HEAD_PARTS = frozenset({"lm_head", "output", "classifier", "pooler"})
EMBED_PARTS = frozenset({"wte", "wpe"})


@dataclass(frozen=True)
class TensorInfo:
    name: str  # Hugging Face (transformers) parameter name
    dtype: torch.dtype  # dtype `load` returns
    shape: tuple[int, ...]


class CheckpointSource(ABC):
    """One checkpoint: side files to embed and a lazily loaded list of tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    @abstractmethod
    def files(self) -> dict[str, bytes]:
        """Model files to embed (config, generation config, tokenizer); never weights."""

    @abstractmethod
    def tensors(self) -> list[TensorInfo]:
        """Every tensor, without loading data."""

    @abstractmethod
    def load(self, name: str) -> torch.Tensor:
        """One tensor: CPU, contiguous, only that tensor read from disk."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory maps; `load` fails afterwards."""

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _error(self, reason: str) -> SourceError:
        return SourceError(self.path, reason)


class StateDictSource(CheckpointSource):
    """Tensors already in memory (tests, benchmarks, the service's own conversions)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], files: dict[str, bytes] | None = None,
                 name: str = "state_dict") -> None:
        super().__init__(Path(name))
        self._tensors = dict(state_dict)
        self._files = dict(files or {})

    @property
    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in self._tensors.items()]

    def load(self, name: str) -> torch.Tensor:
        return self._tensors[name].detach().cpu().contiguous()

    def close(self) -> None:
        self._tensors = {}


# --- safetensors -------------------------------------------------------------------------------


class SafetensorsSource(CheckpointSource):
    """One or more safetensors shards; tensors keep their stored dtype."""

    def __init__(self, path: Path, shards: list[Path], files: dict[str, bytes]) -> None:
        super().__init__(path)
        self._files = files
        self._handles: dict[Path, Any] | None = {s: _safe_open(s) for s in shards}
        self._where: dict[str, Path] = {}
        self._infos: list[TensorInfo] = []
        for shard, handle in self._handles.items():
            for name in handle.keys():
                self._add(name, shard, handle)

    def _add(self, name: str, shard: Path, handle: Any) -> None:
        if name in self._where:
            raise self._error(f"tensor {name!r} appears in {self._where[name].name} and {shard.name}")
        view = handle.get_slice(name)
        dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
        if dtype is None:
            raise self._error(f"tensor {name!r} has unsupported dtype {view.get_dtype()}")
        self._where[name] = shard
        self._infos.append(TensorInfo(name, dtype, tuple(view.get_shape())))

    @property
    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def tensors(self) -> list[TensorInfo]:
        return list(self._infos)

    def load(self, name: str) -> torch.Tensor:
        if self._handles is None:
            raise self._error("source is closed")
        if name not in self._where:
            raise self._error(f"no tensor named {name!r}")
        return self._handles[self._where[name]].get_tensor(name).contiguous()

    def close(self) -> None:
        self._handles = None


def _safe_open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own untyped errors on corrupt headers
        raise SourceError(path, f"not a readable safetensors file ({exc})") from exc


def _read_side_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in SIDE_FILES if (folder / name).is_file()}


def _read_weight_map(folder: Path) -> dict[str, str]:
    index = folder / SAFETENSORS_INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(index, f"unreadable shard index ({exc})") from exc
    if not isinstance(weight_map, dict):
        raise SourceError(index, "weight_map is not an object")
    return weight_map


def _open_sharded(folder: Path, files: dict[str, bytes]) -> SafetensorsSource:
    index = folder / SAFETENSORS_INDEX
    weight_map = _read_weight_map(folder)
    shards = sorted(set(weight_map.values()))
    for name in shards:
        if Path(name).name != name or not (folder / name).is_file():
            raise SourceError(index, f"shard {name!r} is missing or not in the folder")
    source = SafetensorsSource(folder, [folder / name for name in shards], files)
    found = {i.name for i in source.tensors()}
    if found != set(weight_map):
        diff = sorted(found.symmetric_difference(weight_map))[:5]
        raise SourceError(index, f"index and shards disagree on tensors {diff}")
    return source


def _open_hf_folder(folder: Path) -> SafetensorsSource:
    if not (folder / "config.json").is_file():
        raise SourceError(folder, "not a Hugging Face model folder (no config.json)")
    files = _read_side_files(folder)
    if (folder / SAFETENSORS_INDEX).is_file():
        return _open_sharded(folder, files)
    if (folder / SAFETENSORS_SINGLE).is_file():
        return SafetensorsSource(folder, [folder / SAFETENSORS_SINGLE], files)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise SourceError(folder, f"only pickle weights {pickles}; pickle is refused, convert to safetensors")
    raise SourceError(folder, f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}")


# --- GGUF ----------------------------------------------------------------------------------------


class GGUFSource(CheckpointSource):
    """A llama-architecture GGUF file, dequantized per tensor and renamed to HF names."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        super().__init__(path)
        self._dtype = dtype
        self._files: dict[str, bytes] | None = None
        self._reader: gguf.GGUFReader | None = _gguf_reader(path)
        arch = self._field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise self._error(f"unsupported GGUF architecture {arch!r} (supported: {sorted(GGUF_ARCHITECTURES)})")
        self._n_head = int(self._field(f"{arch}.attention.head_count"))
        self._n_kv_head = int(self._field(f"{arch}.attention.head_count_kv", self._n_head))
        self._by_name: dict[str, gguf.ReaderTensor] = {}
        for tensor in self._reader.tensors:
            if tensor.name not in GGUF_DERIVED:
                self._by_name[self._hf_name(tensor.name)] = tensor
        self._tied = "lm_head.weight" not in self._by_name  # no output.weight: head shares token_embd

    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.get_field(key) if self._reader is not None else None
        if field is None:
            if default is None:
                raise self._error(f"GGUF metadata lacks {key!r}")
            return default
        return field.contents()

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
            self._files = _gguf_side_files(self.path, tied=self._tied)
        return dict(self._files)

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(n, self._dtype, _torch_shape(t)) for n, t in self._by_name.items()]

    def load(self, name: str) -> torch.Tensor:
        if self._reader is None:
            raise self._error("source is closed")
        tensor = self._by_name.get(name)
        if tensor is None:
            raise self._error(f"no tensor named {name!r}")
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
        """Heads whose rows llama.cpp permuted: q uses n_head, k uses n_kv_head (as in transformers)."""
        if ".self_attn.q_proj." in name:
            return self._n_head
        if ".self_attn.k_proj." in name:
            return self._n_kv_head
        return None

    def close(self) -> None:
        self._reader = None
        self._by_name = {}


def _gguf_reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path, "r")
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


def _gguf_side_files(path: Path, *, tied: bool) -> dict[str, bytes]:
    """config.json, generation_config.json and tokenizer files, built by transformers from metadata."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(path.parent, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    except (ValueError, OSError, KeyError) as exc:
        raise SourceError(path, f"transformers cannot build config/tokenizer ({exc})") from exc
    config.tie_word_embeddings = tied  # must match the tensors: no output.weight <=> tied head
    files = {
        "config.json": config.to_json_string().encode(),
        "generation_config.json": GenerationConfig.from_model_config(config).to_json_string().encode(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files.update({p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()})
    return files


# --- dispatch ------------------------------------------------------------------------------------


def _sniff(path: Path) -> str:
    """'gguf', 'safetensors', 'pickle' or 'unknown', from the first bytes of the file."""
    with path.open("rb") as f:
        head = f.read(9)
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    if head[:4] == ZIP_MAGIC or head[:1] == bytes([PICKLE_PROTO]):
        return "pickle"
    if len(head) == 9 and head[8:9] == b"{":
        (header_len,) = struct.unpack("<Q", head[:8])  # u64 little-endian JSON header length
        if header_len + 8 <= path.stat().st_size:
            return "safetensors"
    return "unknown"


def open_source(path: str | os.PathLike[str], *, gguf_dtype: torch.dtype = torch.bfloat16) -> CheckpointSource:
    """Open an HF folder, a `.safetensors` file or a llama `.gguf` file for streaming reads."""
    p = Path(path)
    if not p.exists():
        raise SourceError(p, "no such file or directory")
    if p.is_dir():
        return _open_hf_folder(p)
    kind = _sniff(p)
    if p.suffix.lower() in PICKLE_SUFFIXES or kind == "pickle":
        raise SourceError(p, "pickle checkpoints are refused (loading them can run code); convert to safetensors")
    if kind == "gguf":
        return GGUFSource(p, gguf_dtype)
    if kind == "safetensors":
        return SafetensorsSource(p, [p], _read_side_files(p.parent))
    raise SourceError(p, "not a safetensors or GGUF file")


# --- ordering ------------------------------------------------------------------------------------


def layer_index(name: str) -> int | None:
    """N in '.layers.N.' / '.h.N.' / '.layer.N.' / '.blocks.N.', else None."""
    match = LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def _order_key(info: TensorInfo) -> tuple[int, int]:
    layer = layer_index(info.name)
    if layer is not None:
        return (1, layer)
    parts = set(info.name.split("."))
    if parts & HEAD_PARTS:
        return (3, 0)
    if "embed" in info.name or parts & EMBED_PARTS:
        return (0, 0)
    return (2, 0)


def layer_order(infos: list[TensorInfo]) -> list[TensorInfo]:
    """Embeddings, layers 0..N-1, other non-layer tensors, then the head; stable within a group."""
    return sorted(infos, key=_order_key)
