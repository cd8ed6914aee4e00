"""What every checkpoint reader is: `CheckpointSource` (side files to embed, tensors listed without
loading, one tensor loaded at a time) and `TensorInfo`. The readers themselves are in sources.py
(Hugging Face folders, .safetensors, state dicts; `open_source` picks one) and gguf_source.py;
both import this module, and this module imports neither."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from .errors import SourceError


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

    def load_blocks(self, name: str):
        """The tensor's quantized blocks (gguf_blocks.Blocks) when the source keeps them, else None:
        `load(name)` then gives its values."""
        return None

    def extent(self, name: str) -> tuple[int, int, int] | None:
        """(file descriptor, offset, length) of the tensor's bytes as `load` returns them, where they
        lie as they are in an open file (reads in parallel chunks: codec/reads.py), else None."""
        return None

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
