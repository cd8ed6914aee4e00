"""The model store: a directory of `<name>.wcodec` files, where a model's name is its file's stem.

Names are validated before any path is built from them: a plain stem of letters, digits, '.',
'_' and '-', not starting with a dot, so no name can point outside the store."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from codec.errors import CodecError

from ..errors import InvalidModelName
from .names import NAME_PATTERN, SUFFIX, valid_name

__all__ = ["NAME_PATTERN", "SUFFIX", "ModelFile", "ModelStore", "check_name"]


def check_name(name: str) -> str:
    if not valid_name(name):
        raise InvalidModelName(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-' "
                               "(not starting with '.')")
    return name


@dataclass(frozen=True)
class ModelFile:
    """What the store knows of a model without decoding it."""

    name: str
    path: Path
    compressed_bytes: int          # the file's size
    decoded_bytes: int             # sum of its tensors' sizes (from the header)
    mtime_ns: int
    error: str | None = None       # the header could not be read
    inode: int = 0                 # a file replaced (renamed over) has another

    @property
    def version(self) -> tuple[int, int, int]:
        """What tells this file from a rewritten one: a load of a ready model compares it."""
        return self.inode, self.compressed_bytes, self.mtime_ns

    @property
    def ratio(self) -> float:
        return self.compressed_bytes / self.decoded_bytes if self.decoded_bytes else 0.0


class ModelStore:
    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[str, ModelFile] = {}

    def path_of(self, name: str) -> Path:
        path = self.root / f"{check_name(name)}{SUFFIX}"
        if path.parent.resolve() != self.root.resolve():
            raise InvalidModelName(f"invalid model name {name!r}")
        return path

    def scan(self) -> dict[str, ModelFile]:
        """Every model file now in the store (headers re-read only when a file changed)."""
        found = {}
        paths = sorted(self.root.glob(f"*{SUFFIX}")) if self.root.is_dir() else []
        for path in paths:
            if valid_name(path.stem) and path.is_file():
                found[path.stem] = self._describe(path)
        self._cache = found
        return found

    def find(self, name: str) -> ModelFile | None:
        path = self.path_of(name)
        return self._describe(path) if path.is_file() else None

    def _describe(self, path: Path) -> ModelFile:
        stat = path.stat()
        cached = self._cache.get(path.stem)
        if cached and cached.version == (stat.st_ino, stat.st_size, stat.st_mtime_ns):
            return cached
        from codec.decode import Archive         # imports torch: not on `wcodec serve`'s first steps
        try:
            with Archive.open(path) as archive:
                decoded = sum(e.nbytes for e in archive.entries)
            return ModelFile(path.stem, path, stat.st_size, decoded, stat.st_mtime_ns, inode=stat.st_ino)
        except CodecError as e:
            return ModelFile(path.stem, path, stat.st_size, 0, stat.st_mtime_ns, str(e), stat.st_ino)

