"""W8A16: float8_e4m3fn weights multiplied as they are stored (cuda_ext/csrc/fp8.h, fp8_linear.cu).

An fp8 checkpoint's matrix stays its e4m3 bytes (1 byte a weight, half of bf16) beside a float32
grid of scales; `linear` decodes each weight to bf16 in the mma's registers, sums in float32 by
blocks of STEP columns, multiplies each block's sum by its scale (or the whole sum by the row's,
for a grid of one column) and rounds once:

    y[m, n] = bf16( sum_kb scale[n // bo, kb] * sum_{k in kb} x[m, k] * e4m3(w[n, k]) )

That is the checkpoint's own product, where decoded mode multiplies by weights rounded to bf16
first (fp8 scale * e4m3 value, service/model/fp8.py), so the two modes' sums differ in their last
bits. On CUDA the op takes 1..MAX_ROWS rows of bf16 x (K a multiple of 16); on the CPU it is the
reference (the same blocks, ATen's float32 matmul inside each). `dequantize` gives decoded mode's
weights (each e4m3 value times its scale, rounded once), for a prompt's cuBLAS matmul.
"""
from __future__ import annotations

import torch

FP8_OPS = ("wcodec::fp8_to_bf16", "wcodec::fp8_linear", "wcodec::fp8_dequantize")
MAX_ROWS = 64                    # fp8.h kFp8MaxRows
STEP = 128                       # fp8.h kFp8Step: columns a block scale covers
NAN_BYTES = (0x7F, 0xFF)         # e4m3fn's NaN, which fp8.h's steps do not decode


def to_bf16(w: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (uint8, contiguous) -> bf16 words by the kernel's steps (its decode written out;
    on the CPU the C++ twin): torch's float8_e4m3fn -> bf16 cast bit for bit but at NAN_BYTES."""
    return torch.ops.wcodec.fp8_to_bf16.default(w)


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """y = x W^T: x [..., K] bf16, w [N, K] uint8 (e4m3 bytes), scale float32 [ceil(N / bo),
    ceil(K / bi)] with block = (bo, bi) (bi STEP or >= K). On CUDA x has 1..MAX_ROWS rows."""
    y = torch.ops.wcodec.fp8_linear.default(x.reshape(-1, x.shape[-1]), w, scale, block[0], block[1])
    return y.view(*x.shape[:-1], w.shape[0])


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W in bf16: float32(e4m3) * scale, rounded once (service/model/fp8.py's, bit for bit)."""
    return torch.ops.wcodec.fp8_dequantize.default(w, scale, block[0], block[1])


def fits(x_rows: int, w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the CUDA op takes this product (else: dequantize and multiply)."""
    return 1 <= x_rows <= MAX_ROWS and dtype == torch.bfloat16 and w.shape[1] % 16 == 0


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The product in float64 (the error tests' truth): x [M, K], w [N, K] uint8 -> [M, N]."""
    n, k = w.shape
    wf = w.view(torch.float8_e4m3fn).double()
    rows = scale.double().repeat_interleave(block[0], 0)[:n]                           # [N, blocks]
    cols = rows.repeat_interleave(k if scale.shape[1] == 1 else STEP, 1)[:, :k]        # [N, K]
    return x.double() @ (wf * cols).T


def register_fakes() -> None:
    torch.library.register_fake("wcodec::fp8_to_bf16")(lambda w: w.new_empty(w.shape, dtype=torch.bfloat16))
    torch.library.register_fake("wcodec::fp8_linear")(
        lambda x, w, scale, block_rows, block_cols: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake("wcodec::fp8_dequantize")(
        lambda w, scale, block_rows, block_cols: w.new_empty(w.shape, dtype=torch.bfloat16))


def sample_weight(rows: int, cols: int, seed: int, outliers: bool = True) -> torch.Tensor:
    """e4m3 bytes of a trained-like fp8 matrix (per-row spread, rare large weights; no NaN byte)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g)) * 40
    if outliers:
        w[torch.rand(rows, cols, generator=g) < 1e-3] *= 8
    return w.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def sample_inputs(device: str | torch.device) -> list[tuple[str, tuple]]:
    """(op name, args) for opcheck: per-row, per-tensor and 128x128 block scales, 1, 9, 16 and 40
    rows, ragged N and K."""
    out = [("fp8_to_bf16", (torch.arange(256, dtype=torch.uint8).view(16, 16).to(device),))]
    for n, k, block, seed in ((40, 336, (1, 336), 0), (130, 272, (130, 272), 1), (256, 400, (128, STEP), 2)):
        g = torch.Generator().manual_seed(seed)
        grid = (-(-n // block[0]), -(-k // block[1]))
        w, scale = sample_weight(n, k, seed).to(device), (torch.rand(grid, generator=g) / 64).to(device)
        out.append(("fp8_dequantize", (w, scale, *block)))
        for m in (1, 9, 16, 40):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
            out.append(("fp8_linear", (x, w, scale, *block)))
    return out
