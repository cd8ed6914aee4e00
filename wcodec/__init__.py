"""The `wcodec` command line, on top of `codec` (and later `cuda_ext`); nothing imports it.

`wcodec.cli.main` is the entry point; `wcodec.bench` holds the benchmark's measuring code."""
from codec import __version__

__all__ = ["__version__"]
