"""Quantized tensors for tests: GGUF blocks of every kept type (every byte pattern, scale sweeps,
weights quantized by gguf itself), fp8 weights cast the way fp8 checkpoints are made, and a source
that hands blocks to the encoder as a GGUF file would. Import as `from tests.quantized import ...`."""
from __future__ import annotations

import numpy as np
import torch

from codec import gguf_blocks
from codec.encode import compress_source
from codec.sources import StateDictSource

GGUF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GGUF_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")      # gguf's NumPy quantizers; the K types have none
F16_FIELDS = {name: [p[:-3] for p, _ in bt.planes if p.endswith("_hi")] for name, bt in gguf_blocks.BLOCK_TYPES.items()}


def random_blocks(bt: gguf_blocks.BlockType, n_blocks: int, seed: int) -> np.ndarray:
    """Uniform random bytes: every block is valid, scales include NaN, +-inf, -0 and denormals."""
    return np.random.default_rng(seed).integers(0, 256, (n_blocks, bt.type_size), dtype=np.uint8)


def scale_sweep(bt: gguf_blocks.BlockType, field: str, seed: int) -> np.ndarray:
    """65536 random blocks whose f16 `field` takes every value once (the others stay random)."""
    blocks = random_blocks(bt, 1 << 16, seed)
    at = dict(bt.planes)[f"{field}_lo"][0]
    blocks[:, at:at + 2] = np.arange(1 << 16, dtype="<u2").view(np.uint8).reshape(-1, 2)
    return blocks


def quantized_weights(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Bell-shaped weights quantized by gguf's own quantizer (legacy types), else plausible K blocks:
    small positive f16 scales, quants drawn from a bell around the middle of their range."""
    import gguf
    bt = gguf_blocks.BLOCK_TYPES[name]
    rng = np.random.default_rng(seed)
    if name in GGUF_QUANTIZABLE:
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(bt.code)).reshape(-1, bt.type_size)
    blocks = np.clip(rng.normal(128, 24, (rows * cols // bt.block_size, bt.type_size)), 0, 255).astype(np.uint8)
    for field in F16_FIELDS[name]:
        at = dict(bt.planes)[f"{field}_lo"][0]
        blocks[:, at:at + 2] = (rng.random(len(blocks)) * 1e-3 + 1e-4).astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks


def reference_values(bt: gguf_blocks.BlockType, blocks: np.ndarray, shape, dtype: torch.dtype) -> torch.Tensor:
    """What gguf's dequantizer gives, cast by torch: the bits a dense archive stores."""
    import gguf
    with np.errstate(all="ignore"):
        values = gguf.quants.dequantize(np.ascontiguousarray(blocks).reshape(-1), gguf.GGMLQuantizationType(bt.code))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).to(dtype)


class BlocksSource(StateDictSource):
    """Dense tensors plus quantized ones, {name: (Blocks, shape, compute dtype)}: blocks go to the
    encoder as they are (codec gguf), like a GGUF file's kept tensors."""

    def __init__(self, dense: dict[str, torch.Tensor], quantized: dict[str, tuple]) -> None:
        super().__init__(dense | {n: torch.empty(shape, dtype=dt, device="meta")
                                  for n, (_, shape, dt) in quantized.items()})
        self._quantized = quantized

    def load_blocks(self, name: str):
        return self._quantized[name][0] if name in self._quantized else None


def compress_blocks(path, quantized: dict[str, tuple], dense: dict[str, torch.Tensor] | None = None,
                    workers: int = 1):
    with BlocksSource(dense or {}, quantized) as source:
        return compress_source(source, path, workers=workers)


def corrupt_q8_archive(path):
    """A one-tensor Q8_0 archive with a flipped byte near the end of its `qs` plane's stream."""
    from codec.decode import Archive
    bt = gguf_blocks.BLOCK_TYPES["Q8_0"]
    compress_blocks(path, {"w": (gguf_blocks.Blocks(bt, quantized_weights("Q8_0", 200, 1024, seed=8)),
                                 (200, 1024), torch.float16)})
    with Archive.open(path) as archive:
        rec = archive.entries[0].streams["qs"]
    raw = bytearray(path.read_bytes())
    raw[rec["offset"] + rec["length"] - 40] ^= 0x21
    path.write_bytes(bytes(raw))
    return path


def many_tensors(bt: gguf_blocks.BlockType, counts: list[int], seed: int) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """Random blocks for several tensors of one type (block counts `counts`, 0 allowed): each
    tensor's blocks, and every tensor's planes in turn (dequantize_blocks' list order)."""
    blocks = [random_blocks(bt, n, seed=seed + i) for i, n in enumerate(counts)]
    planes = [torch.from_numpy(np.ascontiguousarray(p)) for b in blocks for p in gguf_blocks.split(bt, b).values()]
    return blocks, planes
