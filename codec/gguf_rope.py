"""llama.cpp's `rope_freqs.weight` turned back into the llama3 rope scaling it was made from.

Read me first -- the trap: llama.cpp's converter writes a Llama 3.1+ model's rope scaling as a
tensor, one factor a frequency (its rope divides frequency i by factor i), and no metadata.
transformers' GGUF loader does not read that tensor, so a config built from the metadata alone has
the default rope: every angle of the slowed wavelengths is wrong, the more so the later the
position. The factors, as convert_hf_to_gguf.py's LlamaModel computes them:

    freq_i   = theta^(-2i/d),   wavelen_i = 2π / freq_i
    factor_i = 1                                  wavelen_i < L / hi
             = factor                             wavelen_i > L / lo
             = 1 / ((1 - s_i) / factor + s_i)     between, s_i = (L / wavelen_i - lo) / (hi - lo)

They depend on L / lo and hi / lo alone, so lo = 1 here (Meta's configs say 1). Between, s is a
line in 1 / wavelen: s = a / wavelen + b with a = L / (hi - 1) and b = -1 / (hi - 1), so hi = 1 - 1/b
and L = -a / b, fitted over the smooth band's factors (two or more; Meta's L = 8192, hi = 4
otherwise). Whatever is found is checked by computing every factor again.
"""
from __future__ import annotations

import math

import numpy as np

RTOL = 1e-5                                   # the factors are float32
META = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """The factor of each frequency [head_dim / 2] that a llama3 `scaling` makes (the converter's)."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / _freqs(theta, head_dim)
    s = (old / wavelen - lo) / (hi - lo)
    between = 1 / ((1 - s) / factor + s)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, between))


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """The llama3 rope scaling (transformers' rope_parameters keys) whose factors are `factors`;
    None when every factor is 1. ValueError when no llama3 scaling makes them."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.size != head_dim // 2:
        raise ValueError(f"{f.size} factors for a head of {head_dim} (a factor a frequency: {head_dim // 2})")
    if np.allclose(f, 1.0, rtol=0, atol=RTOL):
        return None
    factor = float(f.max())
    scaling = {"rope_type": "llama3", "factor": factor, **_band(f, factor, theta, head_dim)}
    if factor <= 1 or not np.allclose(llama3_factors(scaling, theta, head_dim), f, rtol=RTOL, atol=0):
        raise ValueError(f"the factors (from {f.min():.6g} to {factor:.6g}) are not those of a llama3 rope scaling")
    return scaling


def _band(f: np.ndarray, factor: float, theta: float, head_dim: int) -> dict:
    """lo, hi and L from the line through the smooth band (lo = 1), or Meta's with under two points."""
    band = (f > 1 + RTOL) & (f < factor * (1 - RTOL))
    if band.sum() < 2:
        return dict(META)
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)              # 1 / f = (1 - s) / factor + s
    a, b = np.polyfit(_freqs(theta, head_dim)[band] / (2 * math.pi), s, 1)
    hi, old = 1 - 1 / b, -a / b
    return {"low_freq_factor": 1.0, "high_freq_factor": _round(hi),
            "original_max_position_embeddings": int(round(old)) if abs(old - round(old)) < 1e-3 * old else old}


def _freqs(theta: float, head_dim: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _round(x: float) -> float:
    return round(x, 6)
