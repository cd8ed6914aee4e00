"""Streaming readers of model checkpoints for the .wcodec encoder.

Read me first -- the traps:
- Nothing here unpickles. Files that look like pickles or torch zip archives, and `.bin`/`.pt`/
  `.pth`/`.ckpt`/`.pkl` files that are not safetensors or GGUF by content, are refused: loading
  them can run arbitrary code. The content decides first: a safetensors file's first byte is the
  low byte of its header length, which may be 0x80, the pickle protocol byte (`_sniff`).
- Tensors are read one at a time: `tensors()` reads only headers, `load(name)` materializes one
  tensor. Safetensors data is read with pread (one descriptor per shard, opened with the source;
  `extent` lets the encoder read chunks of it on several threads), not through safe_open's memory
  map: pages a map has touched count in the process's RSS until it is closed, so streaming a
  sharded model through maps held its whole size resident (14.3 GB for a 7B, docs/BENCHMARKS.md).
- GGUF files are read by codec/gguf_source.py (its own traps are listed there).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .checkpoint import CheckpointSource, TensorInfo
from .constants import MAGIC
from .errors import CodecError, SourceError
from .reads import pread_full

SIDE_FILES = (  # embedded beside the weights; sentence-transformers side files are not needed
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.txt", "merges.txt", "vocab.json", "tokenizer.model",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_RESERVED = "__metadata__"  # a header key of the format, never a tensor's name

GGUF_MAGIC = b"GGUF"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save archives
PICKLE_PROTO = 0x80  # first byte of a pickle of protocol >= 2

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")
HEAD_PARTS = frozenset({"lm_head", "output", "classifier", "pooler"})
EMBED_PARTS = frozenset({"wte", "wpe"})


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
        self._spans: dict[str, tuple[int, int]] = {}
        self._infos: list[TensorInfo] = []
        for shard, handle in self._handles.items():
            self._spans.update(_data_spans(shard))
            for name in handle.keys():
                self._add(name, shard, handle)
        self._by_name = {i.name: i for i in self._infos}
        self._fds: dict[Path, int] | None = {s: os.open(s, os.O_RDONLY) for s in shards}

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

    def extent(self, name: str) -> tuple[int, int, int]:
        if self._fds is None:
            raise self._error("source is closed")
        if name not in self._where:
            raise self._error(f"no tensor named {name!r}")
        begin, end = self._spans[name]
        return self._fds[self._where[name]], begin, end - begin

    def load(self, name: str) -> torch.Tensor:
        fd, offset, nbytes = self.extent(name)
        info = self._by_name[name]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        pread_full(fd, memoryview(buf.numpy()), offset, (self.path, name))
        return buf.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        self._handles = None
        fds, self._fds = self._fds or {}, None
        for fd in fds.values():
            os.close(fd)


def _data_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Absolute byte range of each tensor's data (safe_open has checked the header already)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


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


# --- dispatch ------------------------------------------------------------------------------------


def _sniff(path: Path) -> str:
    """'gguf', 'safetensors', 'wcodec', 'pickle' or 'unknown', from the first bytes of the file.

    The safetensors layout is tested first: its first 8 bytes are a header length, any value,
    so a valid file may begin with 0x80 (a low byte of 0x80) or even with the zip magic (a
    header of 0x04034B50 bytes). GGUF and zip magics and the pickle protocol byte are fixed
    strings and say nothing once the layout fits."""
    with path.open("rb") as f:
        head = f.read(9)
    if _is_safetensors_layout(head, path.stat().st_size):
        return "safetensors"
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    if head[:8] == MAGIC:
        return "wcodec"
    if head[:4] == ZIP_MAGIC or head[:1] == bytes([PICKLE_PROTO]):
        return "pickle"
    return "unknown"


def _is_safetensors_layout(head: bytes, size: int) -> bool:
    """u64 little-endian JSON header length n, then the header's '{', and n + 8 within the file."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    return 2 <= header_len <= size - 8


def open_source(path: str | os.PathLike[str], *, gguf_dtype: torch.dtype = torch.bfloat16,
                gguf_keep: bool = False) -> CheckpointSource:
    """Open an HF folder, a `.safetensors` file or a `.gguf` file (llama, qwen2) for streaming reads.
    A GGUF source loads every tensor dequantized to `gguf_dtype`; with gguf_keep it also hands
    over the blocks of the quantized types that codec gguf keeps (load_blocks)."""
    p = Path(path)
    if not p.exists():
        raise SourceError(p, "no such file or directory")
    if p.is_dir():
        return _open_hf_folder(p)
    kind = _sniff(p)              # the content decides; a pickle suffix refuses only what is neither
    if kind == "pickle" or (kind == "unknown" and p.suffix.lower() in PICKLE_SUFFIXES):
        raise SourceError(p, "pickle checkpoints are refused (loading them can run code); convert to safetensors")
    if kind == "gguf":
        from .gguf_source import GGUFSource  # lazily: only GGUF users need the gguf package
        return GGUFSource(p, gguf_dtype, keep_blocks=gguf_keep)
    if kind == "safetensors":
        return SafetensorsSource(p, [p], _read_side_files(p.parent))
    if kind == "wcodec":
        raise SourceError(p, "is a .wcodec archive, not a checkpoint (`wcodec decompress` makes a .safetensors of it)")
    raise SourceError(p, "not a safetensors or GGUF file")


def refuse_destination(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """A CodecError naming `dst` where writing it would replace a file the input is made of: `src`
    itself (a checkpoint, or the archive being decompressed), or the weights, index or side files
    of a source folder. A new file in the source folder, or an old archive there, is fine."""
    s, d = Path(src), Path(dst)
    if not d.is_file() or not s.exists():
        return
    if s.is_dir():
        ours = d.name in SIDE_FILES or d.name == SAFETENSORS_INDEX or d.suffix.lower() in {".safetensors", ".gguf"}
        hit = ours and d.resolve().parent == s.resolve()
    else:
        hit = os.path.samefile(s, d)
    if hit:
        raise CodecError(d, f"is part of the input {s}: writing it would destroy what is being read; write elsewhere")


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
