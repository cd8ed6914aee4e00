"""The `wcodec` command line's arguments, apart from the commands (wcodec/cli.py): parsing needs no
torch, so that `wcodec compress` knows its files and device before torch imports (wcodec/entry.py
starts work on them meanwhile)."""
from __future__ import annotations

import argparse

import codec

FLOAT_NAMES = ("bfloat16", "float16", "float32")        # cli.FLOAT_CHOICES: their torch dtypes
CAST_NAMES = FLOAT_NAMES + ("float8_e4m3fn", "float8_e5m2")
FP8_SCALES = ("row", "block")
EXIT_ERROR = 1
EXIT_USAGE = 2                          # argparse's status for a usage error


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is ONE line on stderr, as every other error of the
    command line: `wcodec compress: error: <what> (see `wcodec compress --help`)`, status 2
    (argparse prints the whole usage first: five lines for compress). An unknown argument is
    reported by the command that got it, not by `wcodec`."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            commands = getattr(self, "commands", {})
            commands.get(getattr(ns, "command", None), self).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def parse(argv: list[str] | None) -> argparse.Namespace | int:
    """The arguments of one command, or the exit status where parsing ended it (--help, --version,
    a usage error, whose one line the parser has printed)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_ERROR)


def _add(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help)
    sub.commands[name] = p
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _workers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=_positive, default=None, metavar="N",
                   help="the NumPy encoder's worker processes (default: one per CPU, at most 8); the "
                        "extension's encoders, used where it is built, spread over threads of their own")


def _read_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=_positive, default=None, metavar="N",
                   help="threads reading the archive for the decoder (default: two per CPU, at most 16)")


def _gguf_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf-dtype", choices=FLOAT_NAMES, default="bfloat16",
                   help="dtype GGUF tensors are dequantized to (default: bfloat16)")


def _gguf_mode(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", choices=("blocks", "dense"), default="blocks",
                   help="GGUF quantized tensors: keep their blocks, dequantized to --gguf-dtype at load "
                        "(default), or store them dequantized")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="wcodec", description="Lossless compression of model checkpoints.",
                    epilog="wcodec serve [--host H] [--port P] [--store DIR]: serve models over "
                           "HTTP (TGI- and OpenAI-style generation, model control, Prometheus "
                           "metrics); see `wcodec serve --help`")
    parser.add_argument("--version", action="version", version=f"wcodec {codec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.commands = parser.commands = {}
    p = _add(sub, "compress", "compress an HF folder, .safetensors or .gguf into a .wcodec file")
    p.add_argument("src")
    p.add_argument("dst")
    _workers(p)
    _gguf_dtype(p)
    _gguf_mode(p)
    p.add_argument("--codec", choices=("lossless", "int8"), default="lossless",
                   help="int8: LOSSY per-row int8 with tile predictors for 2-D float weights (>= 4096 "
                        "elements), with a quality report; others stay lossless (default: lossless)")
    p.add_argument("--ppl-text", metavar="FILE", default=None,
                   help="with --codec int8: the model's perplexity on this text, before and after")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the planes are encoded: cuda (the GPU encoder), cpu (the C++ encoder, else "
                        "NumPy); auto: cuda when there is a GPU and the extension has its encoder")
    p.set_defaults(prefill=None)          # the archive's codec/container.Prefill: set by wcodec/entry.py
    p = _add(sub, "decompress", "decode a .wcodec file into a .safetensors file")
    p.add_argument("src")
    p.add_argument("dst")
    _read_threads(p)
    p = _add(sub, "inspect", "list the tensors, sizes and embedded files of a .wcodec file")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = _add(sub, "verify", "decode with checksums, optionally compare bit-exactly with a source")
    p.add_argument("file")
    p.add_argument("--against", metavar="SRC", help="checkpoint (HF folder, .safetensors, .gguf) to compare with")
    _read_threads(p)
    _gguf_dtype(p)
    _bench_parser(_add(sub, "bench", "measure ratio and speeds against peer codecs"))
    from .serve import DESCRIPTION, add_arguments       # `wcodec serve` runs from wcodec/entry.py
    add_arguments(_add(sub, "serve", DESCRIPTION))
    return parser


def _bench_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .wcodec file or a checkpoint (HF folder, .safetensors, .gguf)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where our decoder runs")
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="workers/threads for every codec (default: one per CPU, at most 8)")
    p.add_argument("--cast", choices=CAST_NAMES, default=None,
                   help="cast floating tensors first; fp8 keeps the 2-D weights, cast with --fp8-scales")
    p.add_argument("--fp8-scales", choices=FP8_SCALES, default="row",
                   help="fp8 casts divide by per-row or per-128x128-block scales first (default: row)")
    p.add_argument("--repeat", type=_positive, default=3, metavar="R", help="runs per measurement (median)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _gguf_dtype(p)
