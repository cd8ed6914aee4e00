"""fp8 checkpoints served: float8 weights and their scales, dequantized as each layer is decoded.

The archive keeps an fp8 checkpoint as it is (the float codec codes the float8 bytes whole,
losslessly); a load turns each float8 matrix into the model's dtype and drops the scale tensors,
so the model is served as its bf16 twin would be (decoded mode; compressed mode on CUDA keeps the
e4m3 matrices it can multiply as they are: fp8_linear.py). Formats, by config.json's
`quantization_config.quant_method`:

    method              weight            its scale tensor            scale shape
    compressed-tensors  float8_e4m3fn     <linear>.weight_scale       [1] tensor, [out, 1] channel,
      (llm-compressor's FP8, FP8_DYNAMIC,                             [ceil(out/bo), ceil(in/bi)] block
       FP8_BLOCK: RedHatAI's, neuralmagic's)
    fbgemm_fp8          float8_e4m3fn     <linear>.weight_scale       [out, 1]
    fp8 (FineGrainedFP8: float8_e4m3fn   <linear>.weight_scale_inv   [ceil(out/bo), ceil(in/bi)],
         Qwen3-FP8, DeepSeek-V3)                                      weight_block_size [bo, bi]
    none                float8 tensors    -                           (a plain cast: scale 1)

    W[r, c] = dtype(float32(w[r, c]) * float32(scale[r // bo, c // bi]))     # rounded once

(`weight_scale_inv` multiplies too, despite its name, as transformers' and DeepSeek's dequantizers
do.) The product of an fp8 weight and a bf16 scale is exact in float32, so this is the correctly
rounded product that compressed-tensors' own `x_q.to(scale.dtype) * scale` gives; with a float32
scale both round to float32 first, then to the dtype. Static activation scales (`input_scale`,
fbgemm's `input_scale_ub`) and kv-cache scales (`k_scale`, `v_scale`) are dropped: activations
and the cache stay in the model's dtype. Other quantization methods (AWQ, GPTQ, bitsandbytes,
integer compressed-tensors) are refused by name before the load reads a byte.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from codec.constants import CODEC_RAW

from ..errors import LoadFailed

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
METHODS = {"compressed-tensors": "weight_scale", "fbgemm_fp8": "weight_scale", "fp8": "weight_scale_inv"}
DROPPED = ("input_scale", "input_scale_ub", "k_scale", "v_scale")      # suffixes of tensors not served
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CHUNK = 1 << 22                  # weights dequantized at a time (a 16 MB float32 temporary)


@dataclass(frozen=True)
class Scheme:
    """How a model's float8 weights become its dtype."""
    method: str | None           # quant_method, None: float8 tensors with no quantization_config
    dtype: torch.dtype           # the model's (config.json's torch_dtype / dtype; bf16 if unset)
    block: tuple[int, int] | None = None    # [bo, bi] where the config gives it

    @property
    def scale_suffix(self) -> str | None:
        return METHODS.get(self.method)

    def dropped(self, name: str) -> bool:
        """A tensor the served model does not hold: a scale (applied to its weight) or a dropped one."""
        leaf = name.rpartition(".")[2]
        return self.method is not None and (leaf == self.scale_suffix or leaf in DROPPED)


def _quantization(config: dict | None) -> dict:
    """config.json's quantization_config ({} if it has none, or not an object)."""
    q = (config or {}).get("quantization_config")
    return q if isinstance(q, dict) else {}


def _groups(q: dict) -> list[dict]:
    """compressed-tensors' config_groups' `weights` entries."""
    groups = q.get("config_groups")
    groups = groups.values() if isinstance(groups, dict) else []
    return [g["weights"] for g in groups if isinstance(g, dict) and isinstance(g.get("weights"), dict)]


def refusal(config: dict | None) -> str | None:
    """Why a model of `config` cannot be served for its quantization (None: it can)."""
    q = _quantization(config)
    if not q:
        return None
    method = q.get("quant_method")
    if method not in METHODS:
        return (f"its quantization ({method!r}) is not supported: serve its unquantized checkpoint, "
                f"a GGUF file or an fp8 checkpoint ({', '.join(METHODS)})")
    if method == "compressed-tensors":
        weights = _groups(q)
        bad = [w for w in weights if w.get("type") != "float" or w.get("num_bits") != 8]
        if bad or not weights:
            return (f"its compressed-tensors scheme ({bad[0] if bad else 'no config_groups'}) is not supported: "
                    "only 8-bit float (FP8) weights are")
    return None


def scheme(config: dict | None, entries, name: str = "") -> Scheme | None:
    """The dequantization a model of `config` whose header lists `entries` needs; None if it holds
    no float8 tensor. Raises LoadFailed for a quantization it cannot serve (`refusal`)."""
    if (why := refusal(config)) is not None:
        raise LoadFailed(f"model {name!r} cannot be served: {why}")
    if not any(e.torch_dtype in FP8 for e in entries):
        return None
    q, config = _quantization(config), config or {}
    dtype = DTYPES.get(config.get("torch_dtype") or config.get("dtype"), torch.bfloat16)
    block = q.get("weight_block_size") or next((w["block_structure"] for w in _groups(q)
                                                if w.get("strategy") == "block" and w.get("block_structure")), None)
    return Scheme(q.get("quant_method"), dtype, tuple(block) if block else None)


def scheme_of(entries, files: dict[str, bytes], name: str = "") -> Scheme | None:
    """`scheme` of an archive's header entries and embedded files (config.json's, if it is a JSON
    object: the load says what else is wrong with it)."""
    return scheme(_config(files), entries, name)


def _config(files: dict[str, bytes]) -> dict | None:
    """The embedded config.json, None if there is none or it is not a JSON object."""
    try:
        config = json.loads(files.get("config.json") or b"{}")
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def unquantized_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The embedded files with config.json's fp8 quantization_config taken out: the served model
    holds its weights dequantized, and transformers' classes must not build fp8 modules for it."""
    config = _config(files)
    if config is None or _quantization(config).get("quant_method") not in METHODS:
        return files
    config.pop("quantization_config")
    return {**files, "config.json": json.dumps(config).encode()}


def served_entries(entries, s: Scheme | None, kept: dict[str, int] | None = None) -> list:
    """The header's entries as the served model holds them (for the memory budget's estimate):
    float8 matrices decoded in the model's dtype (codec raw), scales and dropped tensors gone, but
    for the weights and scales compressed mode keeps as they are (`kept`: name -> bytes held,
    fp8_linear.served_bytes)."""
    if s is None:
        return list(entries)
    kept = kept or {}
    return [dataclasses.replace(e, nbytes=kept[e.name]) if e.name in kept else
            dataclasses.replace(e, dtype=_name(s.dtype), nbytes=e.numel * s.dtype.itemsize, codec=CODEC_RAW)
            if e.torch_dtype in FP8 else e for e in entries if e.name in kept or not s.dropped(e.name)]


def _name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def dequantize(tensors: dict[str, torch.Tensor], s: Scheme, final: bool = True) -> dict[str, torch.Tensor]:
    """`tensors` (a layer's, or a whole model's) with each float8 weight in the model's dtype
    times its scale, its scale and the dropped tensors left out. Not `final` (a batch of the
    pipeline's): a weight whose scale is not among `tensors` stays as it is, for the last pass."""
    out = {k: t for k, t in tensors.items() if not (s.method is not None and k.rpartition(".")[2] in DROPPED)}
    for name, t in tensors.items():
        if t.dtype not in FP8:
            continue
        scale_name = f"{name.removesuffix('.weight')}.{s.scale_suffix}" if s.scale_suffix else None
        if scale_name is not None and scale_name not in tensors:
            if final:
                raise LoadFailed(f"fp8 weight {name!r} has no {s.scale_suffix!r} tensor beside it")
            continue
        out[name] = _dequantized(name, t, tensors[scale_name] if scale_name else None, s)
        out.pop(scale_name, None)
    return out


def _dequantized(name: str, w: torch.Tensor, scale: torch.Tensor | None, s: Scheme) -> torch.Tensor:
    """w [out, in] (or any shape with no scale) in s.dtype, times `scale` by blocks of rows and
    columns."""
    if scale is None:
        return w.to(s.dtype)
    if w.dim() != 2:
        raise LoadFailed(f"fp8 weight {name!r} of shape {list(w.shape)} is not a matrix")
    grid = scale.float().reshape(grid_shape(name, tuple(w.shape), tuple(scale.shape)))
    return dequantized_grid(w, grid, blocks(name, tuple(w.shape), tuple(grid.shape), s.block), s.dtype)


def grid_shape(name: str, shape: tuple[int, int], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """The scale tensor's shape as a grid over the weight's rows and columns: a scalar or [1] is
    [1, 1] (the tensor's), a vector of a scale a row [out, 1]."""
    numel = int(torch.Size(scale_shape).numel())
    if len(scale_shape) < 2 and numel in (1, shape[0]):
        return numel, 1
    if len(scale_shape) != 2:
        raise LoadFailed(f"fp8 scale of {name!r} has shape {list(scale_shape)}")
    return scale_shape


def dequantized_grid(w: torch.Tensor, grid: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """w [out, in] (float8) times its float32 `grid` of scales, each covering `block` rows and
    columns, rounded once to `dtype`, CHUNK weights at a time."""
    rows, cols = w.shape
    bo, bi = block
    out = torch.empty(rows, cols, dtype=dtype, device=w.device)
    step = max(1, CHUNK // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        first = r0 // bo                                            # the grid rows of rows r0 .. r1 - 1
        g = grid[first:(r1 - 1) // bo + 1].repeat_interleave(bo, 0)[r0 - first * bo:r1 - first * bo]
        g = g if g.shape[1] == 1 else g.repeat_interleave(bi, 1)[:, :cols]     # [r1 - r0, 1 or cols]
        out[r0:r1] = (w[r0:r1].float() * g).to(dtype)
    return out


def blocks(name: str, shape: tuple[int, int], grid: tuple[int, int], block: tuple[int, int] | None) -> tuple[int, int]:
    """Rows and columns of the weight each scale covers: the config's block where the grid is
    its, else what the grid's shape implies ([1, 1]: the tensor; [out, 1]: a row)."""
    rows, cols = shape
    cuts = lambda b: (-(-rows // b[0]), -(-cols // b[1]))                  # noqa: E731
    if block and cuts(block) == grid:
        return block
    implied = -(-rows // grid[0]), -(-cols // grid[1])
    if cuts(implied) != grid:
        raise LoadFailed(f"fp8 scale of {name!r} has shape {list(grid)}, which no blocks cut its weight "
                         f"{list(shape)} into")
    return implied


def dequantizing(decode: Callable, s: Scheme) -> Callable:
    """A pipeline DecodeFn whose batches come out dequantized (a layer's fp8 weights meet their
    scales in its batch; one whose scale is elsewhere is left for the last pass, `dequantize` over
    every tensor)."""
    def run(*args) -> dict[str, torch.Tensor]:
        return dequantize(decode(*args), s, final=False)
    return run
