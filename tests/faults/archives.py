"""Archives that lie, and the readers they are fed to.

Lies are written against the container and its JSON header only (which tensor, which stream
record, which field), never against the inside of a codec's streams, so they hold whatever the
float codec's stream layout becomes:

- `HEADER_LIES`: the header re-written with a valid CRC but lying offsets, lengths, shapes whose
  product overflows, duplicate names and keys, wrong types, deep nesting and huge counts. Every
  one must give a typed `CodecError` whose message starts with the file's path.
- `mutate`: random edits of the data region with the CRC of every stream they touch rewritten
  ("stream CRCs off"): the damage reaches the decoders, and only their own checks and the
  decoded-tensor CRC stand between it and the caller.

`READERS` are every way the project reads an archive; `outcome(reader, path)` runs one with a
time limit and a peak-RSS limit and classifies what it did.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from codec import errors
from codec.constants import PREAMBLE_SIZE, STREAM_ALIGN, TABLE_GROUP_QUANTUM
from codec.container import crc32
from tests.conftest import ArchiveBytes, small_state_dict

# --- the archive that is lied about -------------------------------------------------------------------

FILES = {"config.json": b'{"model_type": "llama", "hidden_size": 8}', "tokenizer.json": b'{"version": "1.0"}'}


def base_state_dict() -> dict[str, torch.Tensor]:
    """tests/conftest's small state dict (bf16 and fp32 float-coded, raw ints, a raw 0-d) plus
    float-coded fp16 and fp8 tensors: every codec and stream role the encoder writes (fp8's one
    stream is coded: no raw plane bounds its shape)."""
    gen = torch.Generator().manual_seed(12)
    return small_state_dict() | {"model.layers.1.w16": (torch.randn(4500, generator=gen) * 0.1).half(),
                                 "model.layers.1.w8": (torch.randn(6000, generator=gen) * 0.1).to(torch.float8_e4m3fn)}


def base_archive(path: Path) -> tuple[ArchiveBytes, dict[str, torch.Tensor]]:
    from codec.encode import compress_state_dict
    state = base_state_dict()
    compress_state_dict(state, path, files=FILES, workers=1)
    return ArchiveBytes(path.read_bytes()), state


# --- header lies -----------------------------------------------------------------------------------


def _first(h: dict, codec: str | None = None) -> dict:
    return next(t for t in h["tensors"] if codec is None or t["codec"] == codec)


def _stream(t: dict) -> dict:
    return t["streams"][sorted(t["streams"])[0]]


def _coded(h: dict) -> dict:
    return next(t for t in h["tensors"] if t["codec"] != "raw")


def _nest(depth: int):
    return json.loads("[" * depth + "]" * depth) if depth < 900 else RawJSON("[" * depth + "]" * depth)


class RawJSON(str):
    """A value written into the header as raw JSON text (for nesting deeper than `json` writes)."""


def _many_tensors(h: dict, count: int) -> None:
    """`count` records that all claim the bytes of one stream."""
    t = _first(h, "raw")
    h["tensors"] += [{**copy.deepcopy(t), "name": f"copy.{i}"} for i in range(count)]


def _zero_dim_huge(h: dict) -> None:
    t = _first(h, "raw")
    t.update(shape=[0, 1 << 70], nbytes=0)
    _stream(t).update(length=0)


def _product_overflows(h: dict) -> None:
    t = _first(h, "raw")
    t.update(shape=[1 << 32, 1 << 32, 1 << 32], nbytes=(1 << 96) * torch.int32.itemsize)


def _fp8_claims(shape: list[int]) -> Callable[[dict], None]:
    """The fp8 tensor claims `shape` (its nbytes to match, its table group valid for any size):
    its coded stream is far too short for so many segments."""
    def lie(h: dict) -> None:
        t = next(t for t in h["tensors"] if t["dtype"] == "float8_e4m3fn")
        t.update(shape=shape, nbytes=math.prod(shape))
        t["params"].update(table_group=TABLE_GROUP_QUANTUM)
    return lie


def _swap_offsets(h: dict) -> None:
    a, b = _stream(_first(h, "raw")), _stream(_coded(h))
    a["offset"], b["offset"] = b["offset"], a["offset"]


def _overlap_two(h: dict) -> None:
    a, b = [_stream(t) for t in h["tensors"][:2]]
    b["offset"] = a["offset"]


HEADER_LIES: dict[str, Callable[[dict], None]] = {
    # offsets and lengths
    "offset-past-end": lambda h: _stream(_first(h)).update(offset=1 << 40),
    "offset-past-u64": lambda h: _stream(_first(h)).update(offset=(1 << 64) + 4096),
    "offset-in-preamble": lambda h: _stream(_coded(h)).update(offset=0),
    "offset-negative": lambda h: _stream(_first(h)).update(offset=-STREAM_ALIGN),
    "offset-unaligned": lambda h: _stream(_coded(h)).update(offset=_stream(_coded(h))["offset"] + 1),
    "offsets-swapped": _swap_offsets,
    "streams-overlap": _overlap_two,
    "length-past-header": lambda h: _stream(_coded(h)).update(length=1 << 40),
    "length-past-u64": lambda h: _stream(_coded(h)).update(length=1 << 64),
    "length-negative": lambda h: _stream(_first(h)).update(length=-1),
    "length-zero": lambda h: _stream(_coded(h)).update(length=0),
    "file-past-end": lambda h: next(iter(h["files"].values())).update(offset=1 << 40),
    "file-overlaps-stream": lambda h: next(iter(h["files"].values())).update(offset=_stream(_first(h))["offset"]),
    # shapes
    "shape-product-overflows": _product_overflows,
    "shape-dim-past-i64": _zero_dim_huge,
    "coded-shape-huge": _fp8_claims([1 << 40]),
    "coded-shape-past-i64": _fp8_claims([1 << 62, 4]),
    "shape-grows": lambda h: _first(h, "raw").update(shape=[2 * _first(h, "raw")["shape"][0]]),
    "shape-negative": lambda h: _first(h, "raw").update(shape=[-1]),
    "shape-of-floats": lambda h: _first(h, "raw").update(shape=[1.5]),
    "shape-of-bools": lambda h: _first(h, "raw").update(shape=[True]),
    # wrong types
    "dtype-number": lambda h: _first(h).update(dtype=5),
    "dtype-unknown": lambda h: _first(h).update(dtype="complex64"),
    "codec-unknown": lambda h: _first(h).update(codec="zstd"),
    "codec-swapped": lambda h: _first(h, "raw").update(codec=_coded(h)["codec"]),
    "name-number": lambda h: _first(h).update(name=7),
    "streams-list": lambda h: _first(h).update(streams=[_stream(_first(h))]),
    "stream-string": lambda h: _first(h)["streams"].update({sorted(_first(h)["streams"])[0]: "4096"}),
    "offset-string": lambda h: _stream(_first(h)).update(offset="4096"),
    "offset-float": lambda h: _stream(_first(h)).update(offset=4096.0),
    "offset-bool": lambda h: _stream(_first(h)).update(offset=True),
    "offset-null": lambda h: _stream(_first(h)).update(offset=None),
    "crc-past-u32": lambda h: _first(h).update(crc32=1 << 32),
    "stream-crc-string": lambda h: _stream(_first(h)).update(crc32="0"),
    "nbytes-string": lambda h: _first(h).update(nbytes=str(_first(h)["nbytes"])),
    "layer-string": lambda h: _first(h).update(layer="0"),
    "params-list": lambda h: _coded(h).update(params=[1, 2]),
    "tensors-object": lambda h: h.update(tensors={"a": _first(h)}),
    "files-list": lambda h: h.update(files=list(h["files"].values())),
    "record-string": lambda h: h["tensors"].append("model.x"),
    "format-missing": lambda h: h.pop("format"),
    # duplicates
    "duplicate-names": lambda h: h["tensors"][1].update(name=h["tensors"][0]["name"]),
    "duplicate-keys": lambda h: h.update(tensors=RawJSON(json.dumps(h["tensors"]) + ', "tensors": []')),
    # deep nesting and huge counts
    "nested-params": lambda h: _coded(h).update(params=_nest(100_000)),
    "nested-metadata": lambda h: h.update(metadata=_nest(100_000)),
    "nested-shape": lambda h: _first(h, "raw").update(shape=_nest(50)),
    "shape-million-dims": lambda h: _first(h, "raw").update(shape=[1] * 1_000_000),
    "tensors-sharing-one-stream": lambda h: _many_tensors(h, 20_000),
    "files-sharing-one-blob": lambda h: h["files"].update(
        {f"f{i}.json": next(iter(h["files"].values())) for i in range(20_000)}),
}


def dumps(header: dict) -> bytes:
    """The header as JSON, with RawJSON values spliced in as they are."""
    raws: list[str] = []

    def walk(o):
        if isinstance(o, RawJSON):
            raws.append(str(o))
            return f"\0RAW{len(raws) - 1}\0"
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        return o

    text = json.dumps(walk(header))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\0RAW{i}\0"), raw)
    return text.encode()


def lying(archive: ArchiveBytes, lie: Callable[[dict], None]) -> bytes:
    header = archive.header
    lie(header)
    return archive.with_header(dumps(header))


# --- data-region mutations ---------------------------------------------------------------------------


def _stream_spans(header: dict) -> list[tuple[int, int]]:
    return [(r["offset"], r["offset"] + r["length"]) for t in header["tensors"] for r in t["streams"].values()]


def mutate(archive: ArchiveBytes, rng: random.Random) -> tuple[bytes, bytes, str]:
    """1-4 random edits of the data region: (with the touched streams' CRCs rewritten, without
    any CRC rewritten, a description). Half the edits aim at one stream picked uniformly (so
    every coded stream is hit often, not only the large raw planes), half anywhere in the region
    (padding and embedded files included); an edit xors a byte, sets it to 0x00/0xFF, or
    overwrites an aligned 4- or 8-byte word (a count, an offset) with 0, all ones or random bits."""
    pre, header = archive.preamble, archive.header
    data = bytearray(archive.data)
    spans = [s for s in _stream_spans(header) if s[1] > s[0]]
    edits = []
    for _ in range(rng.randint(1, 4)):
        start, end = rng.choice(spans) if rng.random() < 0.5 else (pre.data_offset, pre.header_offset)
        at, kind = rng.randrange(start, end), rng.choice(["xor", "set", "word"])
        if kind == "xor":
            data[at] ^= rng.randint(1, 255)
        elif kind == "set":
            data[at] = rng.choice([0, 255])
        else:
            width = rng.choice([4, 8])
            at = max(start, at - at % width)
            n = min(width, end - at)
            word = rng.choice([0, (1 << 8 * width) - 1, rng.getrandbits(8 * width)])
            data[at:at + n] = word.to_bytes(width, "little")[:n]
        edits.append(f"{kind}@{at}")
    plain = bytes(data)
    assert len(plain) == len(archive.data)
    touched = False
    for t in header["tensors"]:
        for rec in t["streams"].values():
            new = crc32(data[rec["offset"]:rec["offset"] + rec["length"]])
            touched |= new != rec["crc32"]
            rec["crc32"] = new
    region = plain[PREAMBLE_SIZE:pre.header_offset]
    rewritten = archive.with_header(header, region) if touched else plain
    return rewritten, plain, " ".join(edits)


# --- readers and outcomes ----------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    kind: str                          # "error" (a typed CodecError), "exact", "differs", "untyped"
    detail: str = ""
    seconds: float = 0.0
    peak_rss_growth: int = 0
    tensors: dict | None = dataclasses.field(default=None, repr=False)


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")                   # resets VmHWM to the current RSS (Linux >= 4.0)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(bytes_of(a[k]), bytes_of(b[k])) for k in a)


def outcome(read: Callable[[Path], dict], path: Path, expected: dict) -> Outcome:
    """Run one reader; classify. A CodecError must name the file; any other exception is untyped."""
    reset_peak_rss()
    base, t0 = peak_rss(), time.perf_counter()
    try:
        got = read(path)
    except errors.CodecError as e:
        kind = "error" if str(e).startswith(str(path)) else "untyped"
        result = Outcome(kind, f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001  (what this classifies)
        result = Outcome("untyped", f"{type(e).__name__}: {e}")
    else:
        result = Outcome("exact" if same(got, expected) else "differs", tensors=got)
    result.seconds = time.perf_counter() - t0
    result.peak_rss_growth = peak_rss() - base
    return result


def _reference(verify: bool) -> Callable[[Path], dict]:
    from codec.decode import load
    return lambda p: load(p, verify=verify, workers=1).state_dict


def _python_api(device: str, verify: bool) -> Callable[[Path], dict]:
    import wcodec
    return lambda p: wcodec.load(p, device, verify=verify).state_dict


def _server_loader(device: str, verify: bool) -> Callable[[Path], dict]:
    from service.load.pipeline import decode_archive
    return lambda p: decode_archive(p, torch.device(device), verify=verify).tensors


def _cli(path: Path) -> dict:
    """`wcodec decompress` in-process: exit 1 with one line naming the file, or a safetensors file."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from safetensors.torch import load_file

    from wcodec import cli
    out, err = path.with_suffix(".safetensors"), io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        status = cli.main(["decompress", str(path), str(out), "--workers", "1"])
    if status == 0:
        return load_file(out)
    line = err.getvalue()
    if status == 1 and line.startswith(f"wcodec: error: {path}") and line.count("\n") == 1:
        raise errors.CodecError(path, line.strip())     # the CLI's one line, re-raised typed for `outcome`
    raise RuntimeError(f"wcodec exited {status}: {line!r}")


def readers(cuda: bool = False) -> dict[str, Callable[[Path], dict]]:
    """name -> read(path) -> {name: tensor}. `*-nv`: stream and tensor CRCs both off."""
    out = {"reference": _reference(True), "twin": _python_api("cpu", True), "cli": _cli,
           "server-loader": _server_loader("cpu", True), "reference-nv": _reference(False),
           "server-loader-nv": _server_loader("cpu", False)}
    if cuda:
        out |= {"cuda": _python_api("cuda", True), "cuda-nv": _python_api("cuda", False),
                "server-loader-cuda": _server_loader("cuda", True),      # stream CRCs on the GPU
                "server-loader-cuda-nv": _server_loader("cuda", False)}
    return out


# --- one mutation through every reader ---------------------------------------------------------------

STRICT = ("reference", "twin", "cli")           # decoded-tensor CRCs on: a typed error or exact bits
STREAM_CHECKED = ("server-loader", "server-loader-cuda")    # stream CRCs on, read from the plain file


@dataclasses.dataclass
class MutationResult:
    edits: str
    outcomes: dict[str, Outcome]
    failures: list[str]


def check_mutation(archive: ArchiveBytes, expected: dict, rng: random.Random, folder: Path,
                   read: dict[str, Callable[[Path], dict]]) -> MutationResult:
    """One random mutation (`mutate`) through every reader in `read`:

    * with the touched streams' CRCs rewritten, the readers that check decoded tensors' CRCs
      (STRICT) give a typed error or exact bits;
    * with no CRC rewritten, the server's loader (stream CRCs on, its default: on the host, or on
      the GPU for CUDA) does too;
    * with every CRC off (`*-nv`), the server's loader and the CUDA decoder agree with the NumPy
      reference: the same bits, or both a typed error.
    Nothing ever raises an untyped exception, runs over TIME_LIMIT or grows the peak RSS by more
    than RSS_LIMIT."""
    rewritten, plain, edits = mutate(archive, rng)
    (folder / "rewritten.wcodec").write_bytes(rewritten)
    (folder / "plain.wcodec").write_bytes(plain)
    runs = {name: outcome(fn, folder / ("plain.wcodec" if name in STREAM_CHECKED else "rewritten.wcodec"),
                          expected) for name, fn in read.items()}
    failures = [f"{name}: {o.kind} {o.detail}" for name, o in runs.items() if o.kind == "untyped"
                or (name in STRICT + STREAM_CHECKED and o.kind == "differs")]
    failures += [f"{name}: {o.seconds:.1f} s" for name, o in runs.items() if o.seconds > TIME_LIMIT]
    failures += [f"{name}: peak RSS +{o.peak_rss_growth >> 20} MiB" for name, o in runs.items()
                 if o.peak_rss_growth > RSS_LIMIT]
    ref = runs.get("reference-nv")
    for name in ("server-loader-nv", "cuda-nv", "server-loader-cuda-nv"):
        got = runs.get(name)
        if ref is None or got is None:
            continue
        agree = (ref.kind == got.kind == "error") or (ref.tensors is not None and got.tensors is not None
                                                     and same(ref.tensors, got.tensors))
        if not agree:
            failures.append(f"{name} disagrees with reference-nv: {got.kind} {got.detail} vs {ref.kind} {ref.detail}")
    for o in runs.values():
        o.tensors = None
    return MutationResult(edits, runs, failures)


TIME_LIMIT = 30.0                # seconds for one read of the ~70 KB archive
RSS_LIMIT = 256 << 20            # peak resident growth of one read
