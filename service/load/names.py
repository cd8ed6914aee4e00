"""Model names and files of the store, importable without anything else (the start-up's first
steps resolve the preloaded models' files before torch or fastapi are imported)."""
from __future__ import annotations

import re

SUFFIX = ".wcodec"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
DEMO_NAME = "smollm2-135m-instruct"
_NAME = re.compile(NAME_PATTERN)


def valid_name(name: str) -> bool:
    """A plain stem of letters, digits, '.', '_' and '-', not starting with a dot, no '..'."""
    return bool(_NAME.fullmatch(name)) and ".." not in name
