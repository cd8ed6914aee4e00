"""The int8 predictive codec (lossy, opt-in: `wcodec compress --codec int8`): the NumPy reference.

Read me first (the traps)
-------------------------
* Lossy. A 2-D weight w [R, C] becomes per-output-channel (row) symmetric int8:
      s_r = max|w_r| / 127   (float32; an all-zero row has s_r = 0 and q = 0)
      q   = clip(rint(w / s_r), -127, 127)
  The decoder gives float32(q) * s_r (one float32 multiply, never fused) cast to the entry's dtype
  (round to nearest even, torch's CPU cast); the entry's CRC32 is of those decoded bits.
* Tiles of 16 x 16 (the last row / column of tiles may be partial). Each tile has a MODE (a byte of
  plane "modes", tiles in row-major order). Prediction reads only the tile's own already-decoded
  values, a neighbour outside the tile being 0, so tiles decode independently:
      0 none      p = 0
      1 left      p = L
      2 top       p = T
      3 average   p = (L + T) >> 1                (floor)
      4 planar    p = clamp(L + T - TL, -127, 127)
  The residual byte is (q - p) mod 256; the decoder's q is (r + p) wrapped to [-128, 127], which
  is exact because the encoder's q lies in [-127, 127].
* Planes: "scales" (R float32, raw), "modes" (one byte per tile) and "resid" (R x C bytes,
  ROW-MAJOR over the tensor, not tile by tile), the last two each stored raw or coded alone in the
  exp-stream layout (ctx_bits 0), whichever is smaller, like GGUF planes.
* Choosing modes by exact coded size: every tile starts at the single mode that makes the
  smallest tensor; each round builds the residual table from the current choice, lets every tile
  take the mode whose residuals cost least under it (plus the mode byte's cost), and is kept only
  if the tensor's exact coded size (tables included) shrinks. On trained weights the predictors
  rarely win (docs/BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import floatcodec, tables

TILE = 16
MODES = ("none", "left", "top", "average", "planar")
ROUNDS = 4                                  # mode-choice rounds at most


@dataclass(frozen=True)
class Quantized:
    """A weight as the codec stores it (before entropy coding)."""

    q: np.ndarray                           # int8 [R, C]
    scales: np.ndarray                      # float32 [R]
    modes: np.ndarray                       # uint8 [ceil(R / 16), ceil(C / 16)]
    resid: np.ndarray                       # uint8 [R, C]


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (q int8 [R, C], scales float32 [R])."""
    w = np.asarray(w, dtype=np.float32)
    scales = (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return np.where(scales[:, None] == 0, 0, q).astype(np.int8), scales


def dequantize(q: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32(q) * s_r, cast to `dtype` by torch."""
    values = q.astype(np.float32) * scales[:, None].astype(np.float32)
    return torch.from_numpy(values).to(dtype)


def _tiled(a: np.ndarray) -> np.ndarray:
    """[R, C] -> [TR, 16, TC, 16], zero-padded."""
    r, c = a.shape
    tr, tc = -(-r // TILE), -(-c // TILE)
    out = np.zeros((tr * TILE, tc * TILE), dtype=a.dtype)
    out[:r, :c] = a
    return out.reshape(tr, TILE, tc, TILE)


def _predictions(t: np.ndarray) -> np.ndarray:
    """Tiled q (int16 [TR, 16, TC, 16]) -> every mode's prediction [5, TR, 16, TC, 16], from the
    tile's own neighbours (0 outside the tile)."""
    left = np.zeros_like(t)
    left[..., 1:] = t[..., :-1]
    top = np.zeros_like(t)
    top[:, 1:] = t[:, :-1]
    top_left = np.zeros_like(t)
    top_left[:, 1:, :, 1:] = t[:, :-1, :, :-1]
    return np.stack([np.zeros_like(t), left, top, (left + top) >> 1, np.clip(left + top - top_left, -127, 127)])


def residuals(q: np.ndarray) -> np.ndarray:
    """int8 [R, C] -> every mode's residual bytes, tiled: uint8 [5, TR, 16, TC, 16]."""
    t = _tiled(q.astype(np.int16))
    return ((t[None] - _predictions(t)) & 0xFF).astype(np.uint8)


def _untile(t: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    tr, _, tc, _ = t.shape
    return t.reshape(tr * TILE, tc * TILE)[:shape[0], :shape[1]]


def _tile_counts(res: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Histogram of each tile's residuals under each mode: [5, TR, TC, 256] (padding excluded)."""
    m, tr, _, tc, _ = res.shape
    valid = _tiled(np.ones(shape, dtype=bool))
    tile = np.broadcast_to(np.arange(tr * tc, dtype=np.int32).reshape(tr, 1, tc, 1), valid.shape)[valid] << 8
    out = np.empty((m, tr * tc * 256), dtype=np.uint16)                  # at most 256 per tile
    for k in range(m):
        out[k] = np.bincount(tile + res[k][valid], minlength=tr * tc * 256)
    return out.reshape(m, tr, tc, 256)


def _size_bits(resid_counts: np.ndarray, modes: np.ndarray) -> float:
    """Exact-ish coded size of a choice: residuals under their one table (12-bit, tables included)
    plus the mode plane at its order-0 cost."""
    freqs = tables.normalize(resid_counts)
    bits = tables.cost_bits(resid_counts, freqs) + 8 * tables.serialized_size(freqs)
    mode_counts = np.bincount(modes.ravel(), minlength=256)
    return bits + tables.cost_bits(mode_counts, tables.normalize(mode_counts))


def _chosen_counts(counts: np.ndarray, modes: np.ndarray) -> np.ndarray:
    """The residual histogram [256] of the whole tensor when tile t uses mode modes[t]."""
    return sum(counts[k][modes == k].sum(axis=0, dtype=np.int64) for k in range(len(MODES)))


def choose_modes(q: np.ndarray) -> np.ndarray:
    """Each tile's mode (uint8 [TR, TC]) by exact coded size, starting from the best single mode."""
    counts = _tile_counts(residuals(q), q.shape)                      # [5, TR, TC, 256] uint16
    modes, best = None, None
    for k in range(len(MODES)):                                        # the best single mode first
        same = np.full(counts.shape[1:3], k, dtype=np.uint8)
        bits = _size_bits(_chosen_counts(counts, same), same)
        if best is None or bits < best:
            modes, best = same, bits
    for _ in range(ROUNDS):
        freqs = tables.normalize(_chosen_counts(counts, modes) + 1)  # +1: every byte priced
        logp = (tables.PROB_BITS - np.log2(freqs.astype(np.float64))).astype(np.float32)
        mode_counts = np.zeros(256, dtype=np.int64)
        mode_counts[:len(MODES)] = np.bincount(modes.ravel(), minlength=len(MODES)) + 1
        mode_bits = tables.PROB_BITS - np.log2(tables.normalize(mode_counts)[:len(MODES)].astype(np.float64))
        cost = np.stack([counts[k] @ logp + np.float32(mode_bits[k]) for k in range(len(MODES))])
        trial = cost.argmin(axis=0).astype(np.uint8)
        bits = _size_bits(_chosen_counts(counts, trial), trial)
        if bits >= best:
            break
        modes, best = trial, bits
    return modes


def encode(w: np.ndarray) -> Quantized:
    """float32 [R, C] -> its int8 form, tile modes and residual bytes."""
    q, scales = quantize(w)
    modes = choose_modes(q)
    res = residuals(q)                                                 # [5, TR, 16, TC, 16]
    tm = np.broadcast_to(modes[:, None, :, None], res.shape[1:]).astype(np.int64)
    resid = _untile(np.take_along_axis(res, tm[None], axis=0)[0], q.shape)
    return Quantized(q, scales, modes, np.ascontiguousarray(resid))


def reconstruct(resid: np.ndarray, modes: np.ndarray) -> np.ndarray:
    """The decoder: residual bytes [R, C] and tile modes -> q int8 [R, C]. Position by position
    within the tiles (raster order), all tiles at once."""
    r = _tiled(resid).astype(np.int16)
    tr, _, tc, _ = r.shape
    m = modes.astype(np.int16)
    zero = np.zeros((tr, tc), dtype=np.int16)
    q = np.zeros_like(r)
    for i in range(TILE):
        for j in range(TILE):
            left = q[:, i, :, j - 1] if j else zero
            top = q[:, i - 1, :, j] if i else zero
            top_left = q[:, i - 1, :, j - 1] if i and j else zero
            pred = np.select([m == 1, m == 2, m == 3, m == 4],
                             [left, top, (left + top) >> 1, np.clip(left + top - top_left, -127, 127)], 0)
            q[:, i, :, j] = ((r[:, i, :, j] + pred + 128) & 0xFF) - 128           # wrap to [-128, 127]
    return _untile(q, resid.shape).astype(np.int8)


def mode_shares(modes: np.ndarray) -> dict[str, int]:
    counts = np.bincount(modes.ravel(), minlength=len(MODES))
    return {name: int(counts[i]) for i, name in enumerate(MODES)}


def prepare_planes(z: Quantized, coder=floatcodec.REFERENCE) -> dict[str, floatcodec.Prepared | None]:
    """The coded form of the modes and resid planes, or None where raw is smaller."""
    return {"modes": coder.prepare_bytes(z.modes.reshape(-1)),
            "resid": coder.prepare_bytes(z.resid.reshape(-1))}
