"""dequantize_blocks' CPU loops (gguf_cpu.h: AVX-512, and the scalar one that WCODEC_CPU_SIMD=0 or a
CPU without AVX-512 runs) against the NumPy reference, bit for bit: every block type and compute
dtype, ragged block counts (one block, odd counts, more than a thread's share), special f16 scales
(NaN payloads, infinities, zeros, subnormals), and planes that start at odd addresses."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from codec import gguf_blocks
from cuda_ext import ops
from tests.cuda_ext.extension import require_cpu_ops
from tests.quantized import GGUF_DTYPES, random_blocks
from tests.tensors import raw_bytes

OPS = ("wcodec::dequantize_blocks",)
REPO = Path(__file__).resolve().parents[2]
COUNTS = (1, 3, 17, 257, 1031)                 # 257 and 1031 blocks: split across threads, ragged
SPECIAL = np.array([0x7C01, 0x7E00, 0xFE01, 0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x03FF, 0x8200,
                    0x0400, 0x7BFF, 0x3C00], "<u2")   # sNaN, qNaN, -NaN, inf, -inf, +-0, subnormals, max, 1


def blocks_with_specials(bt: gguf_blocks.BlockType, n_blocks: int, seed: int) -> np.ndarray:
    """Random blocks (random scales: NaN and subnormal ones among them), every other block's f16
    fields set to SPECIAL values in turn."""
    blocks = random_blocks(bt, n_blocks, seed)
    rng = np.random.default_rng(seed + 1)
    for plane, (at, *_) in bt.planes:
        if plane.endswith("_lo"):                                   # an f16 field: _lo, then _hi
            values = rng.choice(SPECIAL, len(blocks[::2])).astype("<u2")
            blocks[::2, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks


def unaligned(p: np.ndarray) -> torch.Tensor:
    """p's bytes in a tensor that starts one byte past an allocation."""
    t = torch.empty(len(p) + 1, dtype=torch.uint8)[1:]
    t.copy_(torch.from_numpy(np.ascontiguousarray(p)))
    return t


def check_every_type() -> None:
    require_cpu_ops(OPS, "dequantize_blocks")
    for name, bt in gguf_blocks.BLOCK_TYPES.items():
        for n_blocks in COUNTS:
            split = gguf_blocks.split(bt, blocks_with_specials(bt, n_blocks, seed=n_blocks))
            planes = [unaligned(p) for p in split.values()]
            for dtype in GGUF_DTYPES.values():
                got, want = (torch.empty(n_blocks * bt.block_size, dtype=dtype) for _ in range(2))
                ops.dequantize_blocks(planes, bt.code, [got])
                ops.reference_dequantize_blocks(planes, bt.code, [want])
                bad = torch.nonzero(raw_bytes(got).view(-1, dtype.itemsize) != raw_bytes(want).view(-1, dtype.itemsize))
                assert len(bad) == 0, (name, n_blocks, dtype, int(bad[0, 0]))


@pytest.fixture(scope="module", autouse=True)
def twin():
    require_cpu_ops(OPS, "dequantize_blocks")


def test_every_type_and_dtype_matches_the_reference():
    check_every_type()


def test_the_scalar_loop_matches_the_reference():
    """WCODEC_CPU_SIMD=0 (read once a process): the loop a CPU without AVX-512 runs."""
    script = f"import sys; sys.path.insert(0, {str(REPO)!r})\n" \
             "from tests.cuda_ext.test_dequant_cpu import check_every_type\ncheck_every_type()\nprint('scalar ok')"
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "WCODEC_CPU_SIMD": "0"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and "scalar ok" in out.stdout, out.stderr[-2000:]
