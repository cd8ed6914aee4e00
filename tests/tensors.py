"""Tensors for tests, shared by every suite: generators that produce every bit-pattern class,
and bit-exact comparisons (NaN payloads, -0 and bools compared as bytes, never as values).
Import as `from tests.tensors import ...` (pytest runs from the repository root)."""

from __future__ import annotations

import math

import numpy as np
import torch

# Special bit patterns per float dtype: quiet/signalling NaNs with payloads, negative NaN, +-Inf,
# -0, the smallest denormals of both signs, the largest finite value.
SPECIALS = {
    torch.bfloat16: [0x7FC1, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x7F7F],
    torch.float16: [0x7E01, 0x7C01, 0xFFFF, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x83FF, 0x7BFF],
    torch.float32: [0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x80000000,
                    0x00000001, 0x807FFFFF, 0x7F7FFFFF],
}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

def _from_bits(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8)).view(dtype).reshape(shape)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, kind: str) -> torch.Tensor:
    """kind: "bits" (uniform random bit patterns), "normal" (weights), "mixed" (weights with
    ~3% random bit patterns and special values)."""
    n = math.prod(shape)
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(bool)).reshape(shape)
    word = _UINT[dtype.itemsize]
    bits = rng.integers(0, np.iinfo(word).max, size=n, dtype=word, endpoint=True)
    if kind == "bits" or not dtype.is_floating_point:
        return _from_bits(bits, dtype, shape)
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.02).to(dtype)
    if kind == "normal" or n == 0:
        return weights.reshape(shape)
    out = weights.view(torch.uint8).numpy().copy().view(word)
    noisy = rng.random(n) < 0.03
    out[noisy] = bits[noisy]
    specials = np.array(SPECIALS.get(dtype, [0]), dtype=word)
    at = rng.integers(0, n, size=min(n, 4 * len(specials)))
    out[at] = np.resize(specials, len(at))
    return _from_bits(out, dtype, shape)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor: compares NaN payloads, -0 and bools exactly."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (on any devices)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(
        raw_bytes(a.cpu()), raw_bytes(b.cpu()))


def assert_bit_exact(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, ref in expected.items():
        got = actual[name]
        assert got.dtype == ref.dtype, name
        assert tuple(got.shape) == tuple(ref.shape), name
        assert torch.equal(raw_bytes(got), raw_bytes(ref)), name
