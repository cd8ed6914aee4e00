"""The `wcodec` command line: compress, decompress, inspect, verify, bench (`serve`: wcodec/serve.py).

Every failure on bad input (a `CodecError`, an `OSError`, a benchmark that cannot be honest) ends
as ONE line `wcodec: error: <message>` on stderr and exit status 1; an unusable bench device exits
2, Ctrl-C 130. `main(argv)` returns the status, so tests call it in-process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable

_IMPORT_T0 = time.perf_counter()
import torch  # timed: the bulk of `wcodec compress`'s start-up

from codec.decode import Archive, decompress
from codec.encode import compress
from codec.errors import CodecError
from codec.parallel import default_workers
from codec.sources import open_source
from codec.stagetimes import ENV, StageTimes

from . import bench, parser

IMPORT_SECONDS = time.perf_counter() - _IMPORT_T0     # torch and codec: compress's "import" start-up part

FLOAT_CHOICES = {name: getattr(torch, name) for name in parser.FLOAT_NAMES}
CAST_CHOICES = {name: getattr(torch, name) for name in parser.CAST_NAMES}
EXIT_ERROR, EXIT_DEVICE, EXIT_INTERRUPT = parser.EXIT_ERROR, 2, 130


class CliError(Exception):
    """A failure the command reports in one line (message already names the file)."""


def _error(message: str) -> None:
    print(f"wcodec: error: {message}", file=sys.stderr)


def _oserror_message(e: OSError) -> str:
    if e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    return str(e)


# --- compress / decompress -----------------------------------------------------------------------


def _progress_bar() -> tuple[Callable[[int, int], None], Callable[[], None]]:
    from tqdm import tqdm
    bar = tqdm(total=0, unit="B", unit_scale=True, file=sys.stderr, disable=None, desc="compress")

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
    return update, bar.close


def _coder(device: str):
    """The plane coder of `--device` (cuda_ext/encode.py): the GPU's, the C++ twin's or NumPy's."""
    from cuda_ext import encode as ext_encode
    try:
        return ext_encode.coder(ext_encode.best_device() if device == "auto" else device)
    except RuntimeError as e:                  # --device cuda where there is no GPU encoder
        raise bench.DeviceUnavailable(str(e)) from None


def _ppl_text(path: str | None, codec: str) -> str | None:
    """The text of --ppl-text, read before anything is written."""
    if path is None:
        return None
    if codec != "int8":
        raise CliError("--ppl-text measures a lossy compress: give it with --codec int8")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise CliError(f"{path}: not UTF-8 text") from None


def _perplexity(fn, *args) -> float:
    """One side of --ppl-text's report; a model that cannot be built from the checkpoint is one line."""
    from service.errors import ServiceError
    try:
        return fn(*args)
    except ServiceError as e:
        raise CliError(f"--ppl-text: {e}") from None


def cmd_compress(args: argparse.Namespace) -> int:
    text = _ppl_text(args.ppl_text, args.codec)
    times = StageTimes()
    times.add("start-up/import", IMPORT_SECONDS)
    with times.stage("start-up/coder"):
        coder = _coder(args.device)
    times.print_if_asked()
    if text is not None:
        from . import quality
        before = _perplexity(quality.source_perplexity, args.src, text, FLOAT_CHOICES[args.gguf_dtype])
    update, close = _progress_bar()
    try:
        stats = compress(args.src, args.dst, workers=args.workers, gguf_dtype=FLOAT_CHOICES[args.gguf_dtype],
                         gguf_keep=args.gguf == "blocks", lossy=None if args.codec == "lossless" else args.codec,
                         progress=update, coder=coder, prefill=args.prefill)
    finally:
        close()
    if args.prefill is not None and os.environ.get(ENV) == "1":
        print(args.prefill.report(), file=sys.stderr)
    if stats.quality is not None:
        from . import quality
        ppl = None if text is None else (before, _perplexity(quality.archive_perplexity, args.dst, text))
        print(quality.format_report(stats.quality, ppl))
    print(f"{args.dst}: {stats.tensors} tensors, raw {stats.raw_bytes} bytes -> file {stats.file_bytes} "
          f"bytes, ratio {stats.ratio:.4f}, {stats.mb_per_s:.1f} MB/s ({stats.seconds:.2f} s)")
    return 0


def cmd_decompress(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError
    try:
        written = decompress(args.src, args.dst, loader=lambda p: _load_archive(p, args.workers, verify=True))
    except SafetensorError as e:               # save_file's own untyped error on a bad destination
        raise CliError(f"{args.dst}: cannot write ({e})") from None
    print(f"{args.dst}: {written} bytes of tensors written")
    return 0


def _load_archive(path: str, threads: int | None, verify: bool):
    """The service's load pipeline onto the CPU, imported here: `wcodec compress` never needs it."""
    from service.load.pipeline import load_archive
    return load_archive(path, "cpu", verify=verify, threads=threads)


# --- inspect -------------------------------------------------------------------------------------


def inspect_archive(path: str) -> dict:
    """Per-tensor storage, totals and embedded files of an archive, JSON-ready."""
    with Archive.open(path) as archive:
        rows = [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "codec": e.codec,
                 "detail": e.codec_row.describe(e), "raw_bytes": e.nbytes,
                 "stored_bytes": sum(s["length"] for s in e.streams.values()),
                 "streams": {role: s["length"] for role, s in e.streams.items()}}
                for e in archive.entries]
        files = [{"name": n, "size": rec["length"]} for n, rec in archive.reader.header["files"].items()]
        file_bytes = archive.reader.preamble.file_length
        version = archive.reader.header.get("version")
    for r in rows:
        r["ratio"] = r["stored_bytes"] / r["raw_bytes"] if r["raw_bytes"] else 1.0
    raw, stored = sum(r["raw_bytes"] for r in rows), sum(r["stored_bytes"] for r in rows)
    totals = {"tensors": len(rows), "raw_bytes": raw, "stored_bytes": stored, "file_bytes": file_bytes,
              "ratio": stored / max(raw, 1), "file_ratio": file_bytes / max(raw, 1)}
    return {"path": path, "version": version, "tensors": rows, "totals": totals, "files": files}


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def format_inspect(info: dict) -> str:
    rows = [("name", "dtype", "shape", "codec", "stored", "ratio", "detail")]
    rows += [(r["name"], r["dtype"], "x".join(map(str, r["shape"])) or "scalar", r["codec"],
              str(r["stored_bytes"]), f"{r['ratio']:.4f}", r["detail"]) for r in info["tensors"]]
    t = info["totals"]
    lines = [f"{info['path']}: wcodec format {info['version']}", *_table(rows, {4, 5}),
             (f"total: {t['tensors']} tensors, raw {t['raw_bytes']} bytes, stored {t['stored_bytes']} bytes "
              f"(ratio {t['ratio']:.4f}), file {t['file_bytes']} bytes (ratio {t['file_ratio']:.4f})"),
             f"embedded files: {len(info['files'])}"]
    if info["files"]:
        lines += ["  " + line for line in _table([(f["name"], str(f["size"])) for f in info["files"]], {1})]
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_archive(args.file)
    print(json.dumps(info, indent=2) if args.json else format_inspect(info))
    return 0


# --- verify --------------------------------------------------------------------------------------


def tensor_mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why `got` is not bit-identical to `want`, or None."""
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} but the source has {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)} but the source has {list(want.shape)}"
    if not torch.equal(bench.raw_view(got), bench.raw_view(want)):
        return "bytes differ from the source"
    return None


def compare_to_source(state: dict[str, torch.Tensor], src: str, gguf_dtype: torch.dtype) -> list[str]:
    """One message per tensor that is missing, extra or not bit-identical to the source."""
    problems = []
    with open_source(src, gguf_dtype=gguf_dtype) as source:
        names = [i.name for i in source.tensors()]
        problems += [f"tensor {n!r} is in the source but not in the archive" for n in names if n not in state]
        problems += [f"tensor {n!r} is not in the source {src}" for n in state if n not in set(names)]
        for name in (n for n in names if n in state):
            why = tensor_mismatch(state[name], source.load(name))
            if why:
                problems.append(f"tensor {name!r}: {why}")
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    state = _load_archive(args.file, args.workers, verify=True).state_dict
    if args.against is None:
        print(f"OK: {len(state)} tensors bit-exact (every stream matches its checksum, every tensor its CRC32)")
        return 0
    problems = compare_to_source(state, args.against, FLOAT_CHOICES[args.gguf_dtype])
    for why in problems:
        _error(f"{args.file}: {why}")
    if problems:
        return EXIT_ERROR
    print(f"OK: {len(state)} tensors bit-exact against {args.against}")
    return 0


# --- bench ---------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    threads = args.threads or default_workers()
    result = bench.run_bench(args.file, device=args.device, threads=threads, repeat=args.repeat,
                             cast=CAST_CHOICES.get(args.cast), gguf_dtype=FLOAT_CHOICES[args.gguf_dtype],
                             fp8_scales=args.fp8_scales)
    print(json.dumps(result) if args.json else bench.format_table(result))
    return 0


# --- entry point ---------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """`wcodec serve` through main() (the console script dispatches it earlier: wcodec/entry.py)."""
    from .serve import run as serve_run
    return serve_run(args)


COMMANDS = {"compress": cmd_compress, "decompress": cmd_decompress, "inspect": cmd_inspect, "verify": cmd_verify,
            "bench": cmd_bench, "serve": cmd_serve}


def _run(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](args)
    except bench.DeviceUnavailable as e:
        _error(str(e))
        return EXIT_DEVICE
    except (CodecError, bench.BenchError, CliError) as e:
        _error(str(e))
    except BrokenPipeError as e:
        if e.filename is not None:             # a file of the command's, not its standard output
            _error(_oserror_message(e))
        _stdout_gone()
    except OSError as e:
        _error(_oserror_message(e))
    return EXIT_ERROR


def _stdout_gone() -> None:
    """The reader of standard output left (`wcodec inspect x | head`): no error line, as other
    tools; stdout goes to /dev/null so that the interpreter's last flush does not fail again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    args = parser.parse(argv)
    return args if isinstance(args, int) else run(args)


def run(args: argparse.Namespace) -> int:
    """Run one parsed command (wcodec/parser.py); returns the process exit status."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("wcodec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPT
