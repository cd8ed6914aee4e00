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
        if _may_use_cuda(argv) and os.environ.get("WCODEC_EARLY_CUDA") != "0":
            from .early import start_cuda_context     # the CUDA context, made while torch imports
            start_cuda_context()
    from .cli import main as cli_main
    return cli_main(argv)


def _may_use_cuda(argv: list[str]) -> bool:
    """Whether `compress` may encode on the GPU: any --device but cpu (auto, the default, takes one
    where there is one). WCODEC_EARLY_CUDA=0 leaves the context to torch (to time both ways)."""
    for k, arg in enumerate(argv):
        if arg == "--device":
            return argv[k + 1:k + 2] != ["cpu"]
        if arg.startswith("--device="):
            return arg != "--device=cpu"
    return True
