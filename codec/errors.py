"""Typed errors of the `.wcodec` codec.

Every error carries the file it concerns (``path``) and says what is wrong in one line, so the
CLI can print ``str(err)`` and exit non-zero. Nothing in the decoders asserts or aborts on
archive data: a bad byte always becomes one of these.
"""
from __future__ import annotations

import os


class CodecError(Exception):
    """Base of every error raised on bad input or a bad archive."""

    def __init__(self, path: str | os.PathLike | None, what: str):
        self.path = None if path is None else os.fspath(path)
        self.what = what
        super().__init__(f"{self.path}: {what}" if self.path else what)


class NotAWcodecFile(CodecError):
    """The file does not start with the wcodec magic."""


class UnsupportedVersion(CodecError):
    """The file's major format version is not one this reader knows."""


class TruncatedFile(CodecError):
    """The file is shorter than its preamble or header says."""


class HeaderError(CodecError):
    """The header is oversized, not valid JSON, or its sizes/offsets lie."""


class ChecksumError(CodecError):
    """A stored stream or a decoded tensor does not match its CRC32."""


class CorruptStreamError(CodecError):
    """A coded stream is internally inconsistent (bad table, segment overrun, bad final state)."""


class SourceError(CodecError):
    """A checkpoint to compress cannot be read (missing, pickle-based, unknown layout)."""


class UnsupportedTensor(CodecError):
    """A tensor's dtype cannot be stored."""


def _rebuild(cls, path, what):
    return cls(path, what)


CodecError.__reduce__ = lambda self: (_rebuild, (type(self), self.path, self.what))
