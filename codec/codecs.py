"""The codec table: one row per codec an archive may name. The header reader (entries.py), the
reference decoder (decode.py), the encoder (encode.py), the extension's plans and `wcodec inspect`
look codecs up here; none of them branches on a codec's name.

    raw    one stream "raw": the tensor's bytes.
    float  the lossless float codec (floatcodec.py): "exp" coded, "hi" (and for fp32 "lo") raw.
           For fp8 dtypes the whole byte is the symbol: "exp" alone, ctx_bits 0.
    gguf   GGUF quantized blocks (gguf_blocks.py): one stream per block plane, each holding the
           plane's bytes or the plane coded in the exp-stream layout (ctx_bits 0); the entry's
           dtype is the compute dtype the blocks dequantize to at load.
    int8   LOSSY, only when asked for (int8.py): per-row int8 of a 2-D weight, 16x16 tile
           predictors; "scales" raw, "modes" and "resid" each raw or coded like GGUF planes.

A row answers: does it apply to a dtype; its params from the header (validated) and back; the
streams an entry must have and the exact length of each raw one; which streams are coded (all
coded streams of a batch of tensors are rANS-decoded in ONE pass: rans.decode pays per step, not
per symbol); how the decoded planes become the tensor's bytes; and, for the encoder, which planes
of a tensor to code (exact coded size against raw, per plane).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import floatcodec, gguf_blocks, int8, planes
from .constants import CODEC_FLOAT, CODEC_GGUF, CODEC_INT8, CODEC_RAW, MAX_CTX_BITS, SEGMENT_SYMBOLS, TABLE_GROUP_QUANTUM
from .floatcodec import FloatParams

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")      # what GGUF blocks dequantize to


@dataclass(frozen=True)
class GGUFParams:
    """A gguf entry's block type and, per plane, its exp-stream params (coded) or None (raw)."""

    block: gguf_blocks.BlockType
    n_blocks: int
    planes: dict[str, FloatParams | None]

    def to_json(self) -> dict:
        return {"ggml_type": self.block.name,
                "planes": {k: None if p is None else p.to_json() for k, p in self.planes.items()}}


@dataclass
class Encoding:
    """What the encoder stores for one tensor: raw streams, and planes to rANS-code (Prepared)."""

    codec: str
    params: dict | None
    roles: tuple[str, ...]                 # stream order in the file
    raw: dict[str, np.ndarray]
    coded: dict[str, floatcodec.Prepared]
    source: object = None                  # int8: the Quantized form (what the decoder rebuilds)


Item = tuple[floatcodec.ParsedExp, planes.FloatLayout | None, np.ndarray | None]   # floatcodec.decode_batch


def parse_float_params(p, n: int, bad, max_ctx_bits: int = MAX_CTX_BITS) -> FloatParams:
    """Params of one exp stream of n symbols; any value out of range is bad(...)."""
    if not isinstance(p, dict):
        raise bad("float codec without params")
    seg, ctx, group = p.get("segment_symbols"), p.get("ctx_bits"), p.get("table_group")
    if seg != SEGMENT_SYMBOLS:
        raise bad(f"segment_symbols {seg!r} is not {SEGMENT_SYMBOLS}")
    if not (_is_uint(ctx) and ctx <= max_ctx_bits and _is_uint(group) and group >= 1):
        raise bad("ctx_bits/table_group out of range")
    if group % TABLE_GROUP_QUANTUM and group < -(-n // seg):
        raise bad(f"table_group {group} is neither a multiple of {TABLE_GROUP_QUANTUM} nor the whole tensor")
    if n == 0:
        raise bad("float codec on an empty tensor")
    return FloatParams(n, ctx, min(group, -(-n // seg)), seg)


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _parse(buf: np.ndarray, params: FloatParams) -> floatcodec.ParsedExp:
    return floatcodec.parse_exp(buf, params)


class Raw:
    name = CODEC_RAW

    def applies(self, dtype: str) -> bool:
        return True

    def parse(self, p, shape: tuple[int, ...], dtype: str, bad) -> None:
        return None

    def roles(self, dtype: str, params) -> tuple[str, ...]:
        return ("raw",)

    def raw_lengths(self, n: int, itemsize: int, params) -> dict[str, int]:
        return {"raw": n * itemsize}

    def coded(self, dtype: str, params) -> dict[str, FloatParams]:
        return {}

    def rans_items(self, e, streams: dict[str, np.ndarray]) -> list[tuple[str, Item]]:
        return []

    def finish(self, e, streams: dict[str, np.ndarray], symbols: list[np.ndarray], out: np.ndarray) -> None:
        out[:] = streams["raw"]

    def describe(self, e) -> str:
        return ""

    def encode(self, dtype: str, data: np.ndarray, coder=floatcodec.REFERENCE) -> Encoding:
        return Encoding(self.name, None, ("raw",), {"raw": data}, {})


class Float:
    name = CODEC_FLOAT

    def applies(self, dtype: str) -> bool:
        return dtype in planes.FLOAT_LAYOUTS

    def parse(self, p, shape: tuple[int, ...], dtype: str, bad) -> FloatParams:
        return parse_float_params(p, math.prod(shape), bad, 0 if dtype in planes.WHOLE_BYTE else MAX_CTX_BITS)

    def roles(self, dtype: str, params) -> tuple[str, ...]:
        if dtype in planes.WHOLE_BYTE:
            return ("exp",)
        return ("exp", "hi", "lo") if dtype == "float32" else ("exp", "hi")

    def raw_lengths(self, n: int, itemsize: int, params) -> dict[str, int]:
        return {"hi": n, "lo": 2 * n}                  # those of its roles that it has

    def coded(self, dtype: str, params) -> dict[str, FloatParams]:
        return {"exp": params}

    def rans_items(self, e, streams: dict[str, np.ndarray]) -> list[tuple[str, Item]]:
        layout = planes.FLOAT_LAYOUTS[e.dtype]
        return [("", (_parse(streams["exp"], e.params), layout, streams.get("hi")))]

    def finish(self, e, streams: dict[str, np.ndarray], symbols: list[np.ndarray], out: np.ndarray) -> None:
        layout = planes.FLOAT_LAYOUTS[e.dtype]
        lo = streams["lo"].view("<u2") if "lo" in streams else None
        planes.join(layout, symbols[0], streams.get("hi"), lo, out=out.view(layout.word))

    def describe(self, e) -> str:
        what = "whole byte" if e.dtype in planes.WHOLE_BYTE else f"ctx_bits {e.params.ctx_bits}"
        return f"{what}, table_group {e.params.table_group}"

    def plane(self, dtype: str, data: np.ndarray) -> tuple[planes.FloatLayout, np.ndarray]:
        """What a coder prepares for a tensor's bytes: (layout, elements)."""
        layout = planes.FLOAT_LAYOUTS[dtype]
        return layout, data.view(layout.word)

    def encoding(self, dtype: str, p: floatcodec.Prepared | None) -> Encoding | None:
        """The encoding of a tensor whose plane a coder prepared as `p`; None when raw is cheaper."""
        if p is None:
            return None
        raw = {"hi": p.hi, "lo": p.lo}
        roles = self.roles(dtype, p.params)
        return Encoding(self.name, p.params.to_json(), roles, {r: raw[r] for r in roles[1:]}, {"exp": p})


class _Planes:
    """Codecs whose params hold named byte planes, each raw (None) or rANS-coded (its FloatParams)."""

    def coded(self, dtype: str, params) -> dict[str, FloatParams]:
        return {k: p for k, p in params.planes.items() if p is not None}

    def rans_items(self, e, streams: dict[str, np.ndarray]) -> list[tuple[str, Item]]:
        return [(f"plane {k}: ", (_parse(streams[k], p), None, None)) for k, p in self.coded(e.dtype, e.params).items()]


class GGUF(_Planes):
    name = CODEC_GGUF

    def applies(self, dtype: str) -> bool:
        return dtype in COMPUTE_DTYPES

    def parse(self, p, shape: tuple[int, ...], dtype: str, bad) -> GGUFParams:
        n = math.prod(shape)
        if not isinstance(p, dict) or p.get("ggml_type") not in gguf_blocks.BLOCK_TYPES:
            raise bad(f"gguf codec needs a ggml_type among {sorted(gguf_blocks.BLOCK_TYPES)}")
        bt = gguf_blocks.BLOCK_TYPES[p["ggml_type"]]
        if n == 0 or n % bt.block_size:
            raise bad(f"{n} elements are not whole {bt.name} blocks")
        nb = n // bt.block_size
        given = p.get("planes")
        if not isinstance(given, dict) or set(given) != set(bt.plane_names):
            raise bad(f"{bt.name} planes must be exactly {list(bt.plane_names)}")
        coded = {k: None if v is None else parse_float_params(v, nb * bt.plane_width(k), bad, 0)
                 for k, v in given.items()}
        return GGUFParams(bt, nb, {k: coded[k] for k in bt.plane_names})

    def roles(self, dtype: str, params: GGUFParams) -> tuple[str, ...]:
        return params.block.plane_names

    def raw_lengths(self, n: int, itemsize: int, params: GGUFParams) -> dict[str, int]:
        return {k: params.n_blocks * params.block.plane_width(k) for k, p in params.planes.items() if p is None}


    def finish(self, e, streams: dict[str, np.ndarray], symbols: list[np.ndarray], out: np.ndarray) -> None:
        params: GGUFParams = e.params
        decoded = dict(zip(self.coded(e.dtype, params), symbols))
        blocks = gguf_blocks.join(params.block, {k: decoded.get(k, streams[k]) for k in params.planes},
                                  params.n_blocks)
        t = gguf_blocks.dequantize(params.block, blocks, e.shape, e.torch_dtype)
        out[:] = t.reshape(-1).view(torch.uint8).numpy()

    def describe(self, e) -> str:
        params: GGUFParams = e.params
        coded = [k for k, p in params.planes.items() if p is not None]
        share = sum(s["length"] for s in e.streams.values()) / (params.n_blocks * params.block.type_size)
        return f"{params.block.name}, {share:.4f} of its blocks, coded: {' '.join(coded) or 'none'}"

    def encode(self, dtype: str, blocks: gguf_blocks.Blocks, coder=floatcodec.REFERENCE) -> Encoding:
        bt = blocks.block
        split = gguf_blocks.split(bt, blocks.data)
        coded = {k: p for k, p in ((k, coder.prepare_bytes(v)) for k, v in split.items()) if p is not None}
        params = GGUFParams(bt, len(blocks.data), {k: coded[k].params if k in coded else None for k in split})
        return Encoding(self.name, params.to_json(), bt.plane_names,
                        {k: v for k, v in split.items() if k not in coded}, coded)


@dataclass(frozen=True)
class Int8Params:
    """An int8 entry's matrix shape, tiles per mode, and per plane its exp-stream params or None."""

    rows: int
    cols: int
    mode_tiles: tuple[int, ...]
    planes: dict[str, FloatParams | None]

    @property
    def tiles(self) -> tuple[int, int]:
        return -(-self.rows // int8.TILE), -(-self.cols // int8.TILE)

    def to_json(self) -> dict:
        return {"tile": int8.TILE, "mode_tiles": list(self.mode_tiles),
                "planes": {k: None if p is None else p.to_json() for k, p in self.planes.items()}}


class Int8(_Planes):
    """Lossy, opt-in (codec/int8.py): per-row int8, 16x16 tile predictors, residuals coded."""

    name = CODEC_INT8

    def applies(self, dtype: str) -> bool:
        return dtype in COMPUTE_DTYPES

    def parse(self, p, shape: tuple[int, ...], dtype: str, bad) -> Int8Params:
        if len(shape) != 2 or 0 in shape:
            raise bad("int8 codec needs a non-empty 2-D tensor")
        if not isinstance(p, dict) or p.get("tile") != int8.TILE:
            raise bad(f"int8 codec needs tile {int8.TILE}")
        rows, cols = shape
        tr, tc = -(-rows // int8.TILE), -(-cols // int8.TILE)
        tiles = p.get("mode_tiles")
        if not isinstance(tiles, list) or len(tiles) != len(int8.MODES) or not all(_is_uint(t) for t in tiles) \
                or sum(tiles) != tr * tc:
            raise bad(f"mode_tiles must count the {tr * tc} tiles of each of {len(int8.MODES)} modes")
        given = p.get("planes")
        if not isinstance(given, dict) or set(given) != {"modes", "resid"}:
            raise bad("int8 planes must be exactly ['modes', 'resid']")
        sizes = {"modes": tr * tc, "resid": rows * cols}
        planes = {k: None if given[k] is None else parse_float_params(given[k], sizes[k], bad, 0) for k in sizes}
        return Int8Params(rows, cols, tuple(tiles), planes)

    def roles(self, dtype: str, params: Int8Params) -> tuple[str, ...]:
        return ("scales", "modes", "resid")

    def raw_lengths(self, n: int, itemsize: int, params: Int8Params) -> dict[str, int]:
        tr, tc = params.tiles
        sizes = {"scales": 4 * params.rows, "modes": tr * tc, "resid": params.rows * params.cols}
        return {k: v for k, v in sizes.items() if params.planes.get(k) is None}


    def finish(self, e, streams: dict[str, np.ndarray], symbols: list[np.ndarray], out: np.ndarray) -> None:
        params: Int8Params = e.params
        decoded = dict(zip(self.coded(e.dtype, params), symbols))
        modes = decoded.get("modes", streams["modes"]).reshape(params.tiles)
        if modes.size and int(modes.max()) >= len(int8.MODES):
            raise floatcodec.StreamFault(f"a tile mode is {int(modes.max())}: there are {len(int8.MODES)}")
        resid = decoded.get("resid", streams["resid"]).reshape(params.rows, params.cols)
        q = int8.reconstruct(resid, modes)
        t = int8.dequantize(q, streams["scales"].view("<f4"), e.torch_dtype)
        out[:] = t.reshape(-1).view(torch.uint8).numpy()

    def describe(self, e) -> str:
        params: Int8Params = e.params
        total = max(sum(params.mode_tiles), 1)
        shares = " ".join(f"{m} {100 * k / total:.1f}%" for m, k in zip(int8.MODES, params.mode_tiles) if k)
        coded = [k for k, p in params.planes.items() if p is not None]
        return f"tiles: {shares}, coded: {' '.join(coded) or 'none'}"

    def encode(self, dtype: str, w: np.ndarray, coder=floatcodec.REFERENCE) -> Encoding:
        z = int8.encode(w)
        coded = {k: p for k, p in int8.prepare_planes(z, coder).items() if p is not None}
        plain = {"scales": z.scales.astype("<f4").view(np.uint8), "modes": z.modes.reshape(-1),
                 "resid": z.resid.reshape(-1)}
        params = Int8Params(*z.q.shape, tuple(int8.mode_shares(z.modes).values()),
                            {k: coded[k].params if k in coded else None for k in ("modes", "resid")})
        return Encoding(self.name, params.to_json(), ("scales", "modes", "resid"),
                        {k: v for k, v in plain.items() if k not in coded}, coded, z)


CODECS = {c.name: c for c in (Raw(), Float(), GGUF(), Int8())}
INT8_MIN_ELEMENTS = 4096               # smaller 2-D tensors stay lossless


def int8_applies(dtype: str, shape: tuple[int, ...], payload) -> bool:
    """Which tensors `--codec int8` quantizes: floating 2-D weights of at least 4096 elements, all
    finite. A NaN or an infinity stays lossless: its row's scale (max |w| / 127) would be infinite
    and every value of the row decode as NaN."""
    if not (dtype in COMPUTE_DTYPES and len(shape) == 2 and shape[0] * shape[1] >= INT8_MIN_ELEMENTS):
        return False
    return bool(torch.from_numpy(payload).view(getattr(torch, dtype)).isfinite().all())


def encode(dtype: str, payload, shape: tuple[int, ...] = (), lossy: str | None = None,
           coder=floatcodec.REFERENCE) -> Encoding:
    """The encoding of one tensor (encode_many of one)."""
    return encode_many([(dtype, payload, shape)], lossy, coder)[0]


def encode_many(items: list[tuple[str, object, tuple[int, ...]]], lossy: str | None = None,
                coder=floatcodec.REFERENCE) -> list[Encoding]:
    """The encoding of each (dtype, payload, shape): GGUF blocks keep their codec; with lossy="int8"
    the 2-D float weights are int8-coded; floats are float-coded unless raw storage is no larger;
    anything else is raw. `coder` prepares the planes to rANS-code (floatcodec.ReferenceCoder): the
    float planes of all the items in one prepare_many call (the CUDA coder waits once for them)."""
    int8s = {k for k, (dtype, payload, shape) in enumerate(items) if int8_coded(dtype, payload, shape, lossy)}
    floats = [k for k, (dtype, payload, _) in enumerate(items) if k not in int8s and float_applies(dtype, payload)]
    float_codec = CODECS[CODEC_FLOAT]
    prepared = dict(zip(floats, coder.prepare_many([float_codec.plane(*items[k][:2]) for k in floats])))
    out = []
    for k, (dtype, payload, shape) in enumerate(items):
        if isinstance(payload, gguf_blocks.Blocks):
            out.append(CODECS[CODEC_GGUF].encode(dtype, payload, coder))
        elif k in int8s:
            w = torch.from_numpy(payload).view(getattr(torch, dtype)).reshape(shape).float().numpy()
            out.append(CODECS[CODEC_INT8].encode(dtype, w, coder))
        else:
            enc = float_codec.encoding(dtype, prepared[k]) if k in prepared else None
            out.append(enc or CODECS[CODEC_RAW].encode(dtype, payload))
    return out


def int8_coded(dtype: str, payload, shape: tuple[int, ...], lossy: str | None) -> bool:
    """`--codec int8` quantizes this tensor (int8_applies)."""
    return lossy == CODEC_INT8 and not isinstance(payload, gguf_blocks.Blocks) and int8_applies(dtype, tuple(shape), payload)


def float_applies(dtype: str, payload) -> bool:
    return not isinstance(payload, gguf_blocks.Blocks) and CODECS[CODEC_FLOAT].applies(dtype)


def float_coded(dtype: str, payload, shape: tuple[int, ...], lossy: str | None) -> bool:
    """The float codec (lossless) is tried on this tensor."""
    return float_applies(dtype, payload) and not int8_coded(dtype, payload, shape, lossy)
