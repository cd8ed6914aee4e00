"""The `wcodec` console script and `python -m wcodec`: `serve` is dispatched before anything heavy
is imported (its start-up reads models while torch imports); every other command goes to the cli."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from .serve import main as serve_main
        return serve_main(argv[1:])
    from .cli import main as cli_main
    return cli_main(argv)
