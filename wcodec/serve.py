"""`wcodec serve`: start-up as one timeline. Read me first.

    0  the interpreter starts (the timeline's zero is the process's own start)
    1  settings; then each preloaded model's archive starts reading into memory on a thread
       pool (service/load/early_read.py: no torch), verified as it arrives; four 2 MiB requests
       at a time until the imports are done (early_read.ImportGate), then all at once
       and, on a thread, CUDA's runtime (by ctypes) makes the device's context and page-locks the
       first load's ring buffers (service/load/early_pin.py)
    2  import torch; then, per preloaded model, a thread (service/load/early_load.py) takes the
       CUDA context and those buffers, loads the decoder extension and decodes the model from its early read while
       its tokenizer and meta skeleton are built
    3  meanwhile the main thread imports the service (fastapi, uvicorn) and builds the app;
       uvicorn starts; the lifespan's load of each preloaded model takes the early load's result
Only what the forward pass needs is imported on the way (service/model/build.py). With
WCODEC_LOG_LEVEL=debug the timeline is logged once the preloads are done; GET /health/startup
serves it."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from service.timeline import Timeline

from .parser import Parser

DESCRIPTION = "serve models over HTTP: TGI- and OpenAI-style generation, model control, Prometheus metrics"
EXIT_ERROR = 1
FLAGS = {"host": "--host", "port": "--port", "model_store": "--store"}      # Settings field -> flag
IMPORT_SWITCH_INTERVAL = 0.001           # s; Python's default 0.005 let the imports starve the early reads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="address to bind (default: WCODEC_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: WCODEC_PORT or 8000)")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="model store: one <name>.wcodec per model (default: WCODEC_MODEL_STORE or ./models)")


def _settings(args: argparse.Namespace, timeline: Timeline):
    with timeline.span("import pydantic (settings)"):
        from pydantic import ValidationError

        from service.settings import Settings
    given = {k: v for k, v in {"host": args.host, "port": args.port, "model_store": args.store}.items()
             if v is not None}
    try:
        return Settings(**given)
    except ValidationError as e:                 # a flag's error names the flag, not WCODEC_PORT
        names = [FLAGS[err["loc"][0]] if err["loc"] and err["loc"][0] in given else Settings.env_name(err["loc"])
                 for err in e.errors()]
        why = "; ".join(f"{name}: {err['msg']}" for name, err in zip(names, e.errors()))
        print(f"wcodec: error: bad server settings: {why}", file=sys.stderr)
        return None


def _start_early_reads(settings, timeline: Timeline, gate) -> tuple[dict, dict]:
    from service.load import early_read
    paths = early_read.preload_paths(settings) if settings.early_read else {}
    return paths, early_read.start_early_reads(paths, verify=settings.verify_crc, threads=settings.read_threads(),
                                             direct=settings.direct_io(), timeline=timeline, gate=gate)


def _restore_once_read(reads: dict, switch: float) -> None:
    """The short switch interval only helps the early reads along: back to `switch` as soon as
    they are all in (on a 2-core CPU it cost the demo's start ~0.1 s), or at once without any."""
    def restore() -> None:
        for read in list(reads.values()):           # the early loads add to `reads` meanwhile
            try:
                read.wait_until(read.end)
            except Exception:                # the load reports it
                pass
        sys.setswitchinterval(switch)
    threading.Thread(target=restore, name="wcodec-switch-interval", daemon=True).start()


def _start_early_pin(settings, reads: dict, timeline: Timeline):
    from service.load.early_pin import start_early_pin
    return start_early_pin(reads, settings, timeline)


def _start_early_loads(settings, paths: dict, reads: dict, timeline: Timeline, pin=None) -> dict:
    """Decode each preloaded model on its own thread from now on; else only warm up. Nothing more
    is imported here: service.model.build (fastapi, through service.errors) took 0.3-0.5 s on the
    2-core CPU before the early loads could start; they import only what their decode needs."""
    from service.load.early_load import start_early_loads
    if paths:
        return start_early_loads(reads, paths, settings, settings.torch_device(), timeline, pin)
    threading.Thread(target=_warm_up, args=(settings, timeline), name="wcodec-warm-up", daemon=True).start()
    return reads


def _warm_up(settings, timeline: Timeline) -> None:
    from service.model.build import warm_up
    try:
        warm_up(settings.torch_device(), timeline)
    except Exception:                        # the lifespan's own warm-up reports it
        logging.getLogger("wcodec.service").debug("early warm-up failed", exc_info=True)


def run(args: argparse.Namespace, timeline: Timeline | None = None) -> int:
    timeline = timeline or Timeline()
    timeline.mark("wcodec serve: python is up")
    settings = _settings(args, timeline)
    if settings is None:
        return EXIT_ERROR
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from service.load.early_read import ImportGate
    gate = ImportGate()                      # the early reads stay narrow while the imports read files,
    switch = sys.getswitchinterval()         # and get the GIL back soon after each request
    sys.setswitchinterval(IMPORT_SWITCH_INTERVAL)
    paths, reads = _start_early_reads(settings, timeline, gate)
    pin = _start_early_pin(settings, reads, timeline)
    _restore_once_read(reads, switch)
    with timeline.span("import torch"):
        import torch
    if (settings.device or "").startswith("cuda") and not torch.cuda.is_available():
        print(f"wcodec: error: bad server settings: WCODEC_DEVICE={settings.device}, but torch sees no CUDA GPU",
              file=sys.stderr)
        return EXIT_ERROR
    early = _start_early_loads(settings, paths, reads, timeline, pin)
    with timeline.span("import uvicorn, fastapi and the service"):
        import uvicorn

        from service.app import create_app
    gate.open()
    sys.setswitchinterval(switch)
    timeline.mark("imports done: early reads go wide")
    app = create_app(settings, timeline=timeline, early=early)
    timeline.mark("app created; uvicorn starts")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())
    return 0


# OpenMP workers that spin while idle take the cores the event loop, the tokenizer and, on a small
# machine, the clients need: passive waiting, unless the user chose. Read by libgomp when torch
# loads it, so set before torch's import. 2-core CPU, the demo, 32 clients: 58.6 -> 64.7 tokens/s;
# 1 client: 20.0 -> 19.6 (docs/BENCHMARKS.md).
OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def omp_defaults(environ=os.environ) -> None:
    for key, value in OMP_DEFAULTS.items():
        environ.setdefault(key, value)


def main(argv: list[str]) -> int:
    omp_defaults()
    timeline = Timeline()
    parser = Parser(prog="wcodec serve", description=DESCRIPTION)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_ERROR)
    try:
        return run(args, timeline)
    except KeyboardInterrupt:
        print("wcodec: interrupted", file=sys.stderr)
        return 130
