"""The fixed-rate GPU form (codec/fixedrate.py) held as torch tensors, and the calls a layer makes:
`encode` (the transcoder's last step: 16-bit words -> the form, on the words' device), `decode`
(-> words; the scratch of the decode + cuBLAS path and the debug entry point), `linear` (y = x W^T;
up to FUSED_ROWS rows fused on CUDA, more rows decode into a scratch tensor and call cuBLAS). The NumPy references
with the ops' semantics and `sample_inputs` for opcheck are here too.

The transcoder from an archive: the archive's streams are decoded by the existing GPU decoder
(cuda_ext.plans) into a scratch tensor, then `encode` runs on the GPU. Both steps are bit-exact;
the rANS streams are not transcoded straight into the form.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from codec import fixedrate

from . import ops
from .build import ensure_loaded

FUSED_MAX_ROWS = 64            # cuda_ext/csrc/fixedrate_gemv.cuh kFrMaxRows (the tensor-core kernel's)
FUSED_ROWS = 32                # the default's fused rows. Above them decode + cuBLAS, so that a prompt
                               # of 33-64 tokens is prefilled with cuBLAS's sums, as in decoded mode: from
                               # 17 rows the fused op is wide_kernel, faster than decode + cuBLAS up to 64
                               # (an 8B layer at 48 / 64 rows 1.54 / 1.72 of cuBLAS's time against 2.38,
                               # H200, 2026-11-29), but with it up to 64 the demo's greedy tokens in
                               # compressed mode parted from decoded mode's at a near-tie (the haiku
                               # prompt, ~37 tokens; H200 2026-11-29, as on an H100 2026-11-27).
                               # A step of decode rows (and whole prompts of up to 32 tokens) raises it (`fused_rows`)
SLOT_ROWS = 7                  # cuda_ext/csrc/fixedrate_host.h kFrSlotRows: from these rows the kernel reads x
WIDE_ROWS = 17                 # permuted (one m16 tile), and from kFrWideRows in wide_kernel's layout (n8 tiles)
_FUSED = contextvars.ContextVar("wcodec_fused_rows", default=FUSED_ROWS)
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
ARRAYS = ("plane", "lo", "hi", "tile", "esc", "esc_start")   # the ops' array arguments, in order


@dataclass
class FixedRateWeight:
    """One [rows, cols] weight in the fixed-rate form, on one device (codec/fixedrate.FixedRate's arrays)."""
    rows: int
    cols: int
    dtype: torch.dtype
    plane: torch.Tensor         # uint8 [rows, groups*32]
    lo: torch.Tensor            # int32 [rows, groups*2]
    hi: torch.Tensor            # int32 [rows, groups]
    tile: torch.Tensor          # int16 [rows, tiles]: base | escapes << 8
    esc: torch.Tensor           # int16 [n_escapes]: position in the tile | field << 8
    esc_start: torch.Tensor     # int32 [rows, blocks]

    @property
    def arrays(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in ARRAYS)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.arrays)

    @property
    def padded_cols(self) -> int:
        return self.plane.shape[1]

    def to_codec(self) -> fixedrate.FixedRate:
        a = [t.cpu().numpy() for t in self.arrays]
        return fixedrate.FixedRate(self.rows, self.cols, _DTYPES[self.dtype], a[0], a[1].view(np.uint32),
                                   a[2].view(np.uint32), a[3].view(np.uint16), a[4].view(np.uint16), a[5])

    @classmethod
    def from_codec(cls, fr: fixedrate.FixedRate, device: str | torch.device = "cpu") -> FixedRateWeight:
        dtype = next(k for k, v in _DTYPES.items() if v == fr.dtype)
        arrays = (fr.plane, fr.lo.view(np.int32), fr.hi.view(np.int32), fr.tile.view(np.int16), fr.esc.view(np.int16),
                  fr.esc_start)
        return cls(fr.rows, fr.cols, dtype, *(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays))


def cat_rows(parts: list[FixedRateWeight]) -> FixedRateWeight:
    """The parts' rows stacked into one weight (same cols and dtype). Rows are independent in the
    form but for esc_start, an index into esc: each part's starts move by the escapes before it."""
    first = parts[0]
    if any(p.cols != first.cols or p.dtype != first.dtype or p.plane.device != first.plane.device for p in parts):
        raise ValueError("cat_rows joins weights of one cols, dtype and device")
    offsets = list(itertools.accumulate((p.esc.numel() for p in parts), initial=0))
    if offsets[-1] >= 2 ** 31:
        raise ValueError(f"cat_rows: {offsets[-1]} escapes do not fit esc_start's int32")
    esc_start = torch.cat([p.esc_start + int(off) for p, off in zip(parts, offsets)])
    joined = FixedRateWeight(sum(p.rows for p in parts), first.cols, first.dtype,
                             *(torch.cat([getattr(p, a) for p in parts]) for a in ARRAYS[:-1]), esc_start)
    if esc_start.is_cuda:                  # complete before a fused kernel reads it (W before its PDL wait)
        torch.cuda.current_stream(esc_start.device).synchronize()
    return joined


def row_views(w: FixedRateWeight, rows: list[int]) -> list[FixedRateWeight]:
    """w's rows split into weights of `rows` rows each, as views (no copy): each keeps w's whole
    esc, which its rows of esc_start index into."""
    cuts = {name: getattr(w, name).split(rows) for name in ARRAYS if name != "esc"}
    return [FixedRateWeight(n, w.cols, w.dtype, esc=w.esc, **{k: v[i] for k, v in cuts.items()}) for i, n in enumerate(rows)]


def encode(w: torch.Tensor) -> FixedRateWeight:
    """A contiguous 2-D bfloat16/float16 weight -> its fixed-rate form, on w's device (host syncs
    for the escape count and at the end, so that the form is complete before a fused kernel reads
    it: a load-time call, not for captured graphs)."""
    if w.dtype not in _DTYPES:
        raise TypeError(f"the fixed-rate form holds bfloat16 or float16 weights, not {w.dtype}")
    ensure_loaded()
    arrays = ops.fixedrate_encode(w.contiguous())
    return FixedRateWeight(w.shape[0], w.shape[1], w.dtype, *arrays)


def decode(fr: FixedRateWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact weight back ([rows, cols], fr.dtype), written into `out` if given."""
    ensure_loaded()
    out = torch.empty(fr.rows, fr.cols, dtype=fr.dtype, device=fr.plane.device) if out is None else out
    ops.fixedrate_decode(*fr.arrays, fr.cols, out)
    return out


@contextlib.contextmanager
def fused_rows(rows: int) -> Iterator[None]:
    """`linear`'s default fuses up to `rows` rows (FUSED_ROWS .. FUSED_MAX_ROWS) inside this block,
    in this thread or task: the engine's 33-64-row steps of decode rows (and of whole prompts that
    alone would be fused) multiply in wide_kernel instead of decode + cuBLAS. A CUDA graph
    captured inside the block keeps the fused op."""
    if not FUSED_ROWS <= rows <= FUSED_MAX_ROWS:
        raise ValueError(f"fused_rows: {rows} rows, not in {FUSED_ROWS}..{FUSED_MAX_ROWS}")
    token = _FUSED.set(rows)
    try:
        yield
    finally:
        _FUSED.reset(token)


def fused_limit() -> int:
    """The rows up to which `linear`'s default fuses here (FUSED_ROWS outside `fused_rows`)."""
    return _FUSED.get()


def linear(x: torch.Tensor, fr: FixedRateWeight, kernel: int | None = None) -> torch.Tensor:
    """y = x W^T (x [..., cols] in fr.dtype): on CUDA the fused op (kernel 0 tensor cores, 1..64
    rows; 1 CUDA cores, 1..16 rows). By default tensor cores for 1..FUSED_ROWS (at one row too since
    escapes are listed: an 8B layer on an H100 0.163 vs 0.171 ms; up to `fused_limit()` inside
    `fused_rows`), above that decode + cuBLAS (_decode_matmul). Launches on the current stream, no
    host syncs (usable in CUDA graphs)."""
    if isinstance(x, PermutedX):                     # made for this row count's kernel (a step of the same fused_limit)
        return ops.fixedrate_linear_permuted(x.data, x.rows, *fr.arrays, fr.cols)
    flat = x.reshape(-1, fr.cols)
    if flat.shape[0] > (fused_limit() if kernel is None else FUSED_MAX_ROWS) or flat.shape[0] == 0 or not x.is_cuda:
        return _decode_matmul(flat, fr).reshape(*x.shape[:-1], fr.rows)
    if fr.padded_cols != fr.cols:
        flat = F.pad(flat, (0, fr.padded_cols - fr.cols))
    y = ops.fixedrate_linear(flat.contiguous(), *fr.arrays, fr.cols, 0 if kernel is None else kernel)
    return y.reshape(*x.shape[:-1], fr.rows)


def permuted_rows(n: int) -> int:
    """Rows of x's permuted layout for n rows (fixedrate_host.h fr_permuted_rows): 0 where the fused op
    reads x in place (under SLOT_ROWS rows) or does not take the rows (over fused_limit()); 16 up to
    16 rows (one m16 tile); else whole n8 tiles. A step's kernels that make x may write it so
    (`PermutedX`), which saves the op its permute launch: the served step 1.5-3.4 % faster at 8-32
    rows (H200, 2026-11-30)."""
    if not SLOT_ROWS <= n <= fused_limit():
        return 0
    return 16 if n < WIDE_ROWS else -(-n // 8) * 8


def permuted_cols(cols: int) -> int:
    """Columns of the permuted layout for x of `cols` columns: whole tiles of 128, zeros past cols."""
    return -(-cols // fixedrate.TILE) * fixedrate.TILE


@dataclass(frozen=True)
class PermutedX:
    """x [rows, cols] (the first `rows` of `data`'s padded rows) written in the layout the fused
    kernel reads at that row count (`permuted_rows`): data [permuted_rows(rows), permuted_cols(cols)],
    zeros past rows and cols. `linear` takes it where it would take x."""
    data: torch.Tensor
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device


def permute(x: torch.Tensor) -> PermutedX:
    """x [n, cols] with permuted_rows(n) > 0 in the layout, by the C++ twin's map
    (ops.fixedrate_permuted_index, fixedrate_host.h fr_permuted_at): the reference that the step's
    kernels (step_triton's _x_at) and the CUDA permutes are held to, bit for bit, by
    tests/cuda_ext/test_fixedrate_twin.py and tests/gpu."""
    n, cols = x.shape
    rows = permuted_rows(n)
    if not rows:
        raise ValueError(f"permute: {n} rows take no permuted layout (at most {fused_limit()} here)")
    ensure_loaded()
    index = ops.fixedrate_permuted_index(n, cols).to(x.device)
    padded = torch.zeros(index.shape, dtype=x.dtype, device=x.device)
    padded[:n, :cols] = x
    data = torch.empty_like(padded)
    data.view(-1)[index.flatten()] = padded.flatten()
    return PermutedX(data, n, cols)


def _decode_matmul(flat: torch.Tensor, fr: FixedRateWeight) -> torch.Tensor:
    """[n, cols] @ W^T through a decoded scratch copy of W and cuBLAS. (Decoding in L2-sized row
    chunks measured slower, one scratch reused: an 8B layer at 64 rows on an H200, 2026-11-28,
    0.343 ms whole against 0.363-0.709 ms in chunks of 48-8 MB; and pipelined, chunks decoding
    on one stream while cuBLAS takes the chunk before from L2, 2026-11-29: 2.39-6.5 of cuBLAS
    against 2.34 whole, bench/experiments/decode_pipeline.py.)"""
    return F.linear(flat, decode(fr))


# ---- references with the ops' semantics (CPU tensors) --------------------------------------

def reference_encode(w: torch.Tensor) -> list[torch.Tensor]:
    fr = fixedrate.encode(w.contiguous().view(torch.int16).numpy().view(np.uint16), _DTYPES[w.dtype])
    return list(FixedRateWeight.from_codec(fr).arrays)


def reference_decode(plane, lo, hi, tile, esc, esc_start, cols: int, out: torch.Tensor) -> None:
    fr = fixedrate.FixedRate(plane.shape[0], cols, "bfloat16", plane.numpy(), lo.numpy().view(np.uint32),
                             hi.numpy().view(np.uint32), tile.numpy().view(np.uint16), esc.numpy().view(np.uint16),
                             esc_start.numpy())
    out.view(torch.int16).copy_(torch.from_numpy(fixedrate.decode(fr).view(np.int16)))


def reference_linear(x, plane, lo, hi, tile, esc, esc_start, cols: int) -> torch.Tensor:
    """float32 matmul on the decoded weights, one rounding to x's dtype (x unpadded or padded)."""
    w = torch.empty(plane.shape[0], cols, dtype=x.dtype)
    reference_decode(plane, lo, hi, tile, esc, esc_start, cols, w)
    return (x[:, :cols].float() @ w.float().T).to(x.dtype)


def sample_weight(dtype: torch.dtype, rows: int, cols: int, seed: int, finite: bool = False) -> torch.Tensor:
    """Weights around 0.02 with 2 % random bit patterns (escapes: NaNs, Infs, subnormals, zeros;
    with `finite`, bit 14 cleared in them: no NaN or Inf, for comparing products)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(dtype)
    noisy = torch.rand(rows, cols, generator=g) < 0.02
    bits = torch.randint(-32768, 32768, (rows, cols), generator=g, dtype=torch.int32)
    bits = (bits & ~0x4000 if finite else bits).to(torch.int16)
    w.view(torch.int16)[noisy] = bits[noisy]
    return w


def padded_x(n: int, fr: FixedRateWeight, seed: int) -> torch.Tensor:
    """x [n, padded_cols] for the fused op: random up to cols, zero after."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, fr.padded_cols)
    x[:, :fr.cols] = torch.randn(n, fr.cols, generator=g)
    return x.to(fr.dtype)


def sample_inputs(device: str | torch.device) -> list[tuple[str, tuple]]:
    """(op name, args) for opcheck: both dtypes, ragged cols, escapes, 1, 16 and 40 rows of x (7, 16
    and 40 permuted)."""
    out = []
    for dtype, (rows, cols) in ((torch.bfloat16, (40, 1000)), (torch.float16, (8, 64))):
        w = sample_weight(dtype, rows, cols, 0).to(device)
        out.append(("fixedrate_encode", (w,)))
        out.append(("fixedrate_decode", (*encode(w).arrays, cols, torch.empty_like(w))))
        fr = encode(sample_weight(dtype, rows, cols, 1, finite=True).to(device))
        out += [("fixedrate_linear", (padded_x(n, fr, n).to(device), *fr.arrays, cols)) for n in (1, 16, 40)]
        with fused_rows(FUSED_MAX_ROWS):
            xs = [permute(padded_x(n, fr, n)[:, :cols].to(device)) for n in (7, 16, 40)]
        out += [("fixedrate_linear_permuted", (x.data, x.rows, *fr.arrays, cols)) for x in xs]
    return out
