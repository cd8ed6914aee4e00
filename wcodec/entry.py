"""The `wcodec` console script and `python -m wcodec`: `serve` is dispatched before anything heavy
is imported (its start-up reads models while torch imports); every other command goes to the cli."""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from .serve import main as serve_main
        return serve_main(argv[1:])
    if argv[:1] == ["compress"]:
        # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, so the reading and
        # checksum threads beside the encoder get the cores (MiniLM bf16 on 2 cores: 178 -> 619 MB/s).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return _compress(argv)
    from .cli import main as cli_main
    return cli_main(argv)


def _compress(argv: list[str]) -> int:
    """Parse (no torch needed), start the early work (wcodec/early.py), then import and run."""
    from . import early, parser
    args = parser.parse(argv)
    if isinstance(args, int):
        return args
    args.prefill = early.start(args)
    try:
        from .cli import run
        return run(args)
    finally:
        if args.prefill is not None:
            args.prefill.discard()

