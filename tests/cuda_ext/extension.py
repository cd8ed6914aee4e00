"""The twin tests' one precondition: the C++ extension is built, with the ops under test."""
from __future__ import annotations

import pytest

import cuda_ext
from cuda_ext import ops


def require_cpu_ops(names: tuple[str, ...], what: str) -> None:
    """Fail (never skip: CI builds the extension) unless the C++ twin is loaded with `names`."""
    avail = cuda_ext.available()
    assert avail.cpp, f"the C++ twin must build in CI: {avail.reason}"
    if not ops.has_ops(names, "cpu"):
        pytest.fail(f"the extension lacks {what}: rebuild it (python setup.py build_ext --inplace)")
