"""GGUF blocks kept quantized in compressed-resident mode (docs/RESIDENT.md), as llama.cpp keeps
them: a GGUF archive's matrices stay their blocks on the device (a Q4_1 weight is 0.625 bytes,
0.31 of bf16), and nothing holds a decoded copy of them.

* A Linear of blocks (`BlockLinear`) dequantizes its weight into a scratch buffer just before its
  matmul, a chunk of at most CHUNK weights at a time; the model's block Linears share that one
  buffer (the model runs one forward at a time, on one stream).
* The embedding (`BlockEmbedding`) dequantizes only the rows it gathers (llama.cpp's get_rows).
  A tied head multiplies by the same blocks, a chunk of rows at a time: the demo's 49152 x 576
  table in 7 chunks (28 under the CPU's mixed matmul: a chunk is one of its blocks).
* Each chunk's matmul is the Linear's own (`kernel`): PyTorch's, or on the CPU decoded mode's
  (cpu_dtype.py: linear16, or the mixed matmul, whose chunks start where its blocks of rows do), so
  both modes give the same tokens.
* The modules launch on the current stream and allocate through PyTorch, so a decode step of
  them is captured as a CUDA graph like any other.

    planes   uint8 [rows x blocks a row x width] each (cuda_ext.quant.QuantBlocks)
    scratch  [CHUNK or the largest block Linear's weights] of the archive's dtype
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from codec.constants import CODEC_GGUF
from codec.gguf_blocks import BlockType
from cuda_ext import quant

from . import llama

CHUNK = 1 << 22                  # weights a block Linear dequantizes at a time (8 MB of bf16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def keeps(e) -> bool:
    """Whether compressed-resident mode keeps a tensor as its GGUF blocks: a matrix (a Linear's
    weight or the embedding table) of a dtype dequantize_blocks writes."""
    return e.codec == CODEC_GGUF and len(e.shape) == 2 and e.torch_dtype in DTYPES


def _chunk_rows(rows: int, cols: int) -> int:
    return min(rows, max(1, CHUNK // cols))


def scratch_numel(shapes) -> int:
    """Elements of the scratch that block Linears of `shapes` [out, in] share: their largest chunk."""
    return max((_chunk_rows(rows, cols) * cols for rows, cols in shapes), default=0)


def estimate_bytes(kept: list) -> int:
    """Device bytes of the kept tensors: their blocks, and the scratch buffer (in the first one's
    dtype, as `attach` makes it; counting an untied embedding's chunk too, which only gathers rows)."""
    blocks = sum(e.params.n_blocks * e.params.block.type_size for e in kept)
    return blocks + (scratch_numel([e.shape for e in kept]) * kept[0].torch_dtype.itemsize if kept else 0)


class _Planes(torch.nn.Module):
    """Holds a tensor's planes as buffers, so that an unload's `model.to("meta")` frees them."""

    def _hold(self, block: BlockType, planes: list[torch.Tensor], dtype: torch.dtype) -> None:
        self.block, self.dtype, self.n_planes = block, dtype, len(planes)
        for k, p in enumerate(planes):
            self.register_buffer(f"plane{k}", p, persistent=False)

    @property
    def planes(self) -> list[torch.Tensor]:
        return [getattr(self, f"plane{k}") for k in range(self.n_planes)]


class BlockEmbedding(_Planes):
    """An embedding table of blocks: ids [...] -> [..., E], only the gathered rows dequantized."""

    def __init__(self, kept: quant.QuantBlocks):
        super().__init__()
        self._hold(kept.block, kept.planes, kept.dtype)
        self.num_embeddings, self.embedding_dim = kept.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.embedding_dim, dtype=self.dtype, device=ids.device)   # [N, E]
        quant.gather_rows(self.block, self.planes, ids.reshape(-1), out)
        return out.view(*ids.shape, self.embedding_dim)


class BlockLinear(_Planes):
    """y = x W^T (+ b) with W [out, in] as blocks: dequantized into `scratch` a chunk of output
    rows at a time, each chunk multiplied by `kernel`."""
    holds_blocks = True                          # llama.tie_weights leaves a head of blocks as it is

    def __init__(self, linear: torch.nn.Linear, block: BlockType, planes: list[torch.Tensor], dtype: torch.dtype,
                 scratch: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._hold(block, planes, dtype)
        self.bias = linear.bias                  # on meta until the load assigns it
        self.register_buffer("scratch", scratch, persistent=False)
        self.kernel: Callable = F.linear
        self.rows = scratch.numel() // self.in_features          # output rows a chunk (use_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step, planes, parts = self.rows, self.planes, []
        for start in range(0, self.out_features, step):
            n = min(step, self.out_features - start)
            w = self.scratch[:n * self.in_features].view(n, self.in_features)           # [n, in]
            quant.dequantize_rows(self.block, planes, w, start)
            parts.append(self.kernel(x, w, None if self.bias is None else self.bias[start:start + n]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)                    # [..., out]


def attach(model: llama.LlamaForCausalLM, kept: dict[str, quant.QuantBlocks], device: torch.device) -> int:
    """Put block modules in place of the Linears and the embedding whose weights were `kept` (in
    `model`, still on meta: the load assigns the other tensors after), a tied head included.
    Returns their device bytes: blocks and the shared scratch."""
    linears = {name.removesuffix(".weight"): k for name, k in kept.items()}
    embed = linears.pop("model.embed_tokens", None)
    if embed is not None and model.config.tie_word_embeddings:
        linears["lm_head"] = embed
    dtype = next(iter(kept.values())).dtype
    scratch = torch.empty(scratch_numel([k.shape for k in linears.values()]), dtype=dtype, device=device)
    for path, k in linears.items():
        owner, attr = llama.owner_of(model, path)
        setattr(owner, attr, BlockLinear(getattr(owner, attr), k.block, k.planes, k.dtype, scratch))
    if embed is not None:
        model.model.embed_tokens = BlockEmbedding(embed)
    return sum(k.nbytes for k in kept.values()) + scratch.nbytes


def dequantized(kept: dict[str, quant.QuantBlocks]) -> dict[str, torch.Tensor]:
    """The kept tensors dequantized whole (a model these modules do not serve)."""
    out = {}
    for name, k in kept.items():
        out[name] = torch.empty(k.shape, dtype=k.dtype, device=k.planes[0].device)
        quant.dequantize_rows(k.block, k.planes, out[name])
    return out


def use_kernel(model: torch.nn.Module, kernel: Callable, block: Callable[[int], int] | None = None) -> None:
    """Every block Linear's chunks multiplied by `kernel` (x, weight, bias) -> y. With `block`
    (in_features -> rows: `kernel` splits a weight into blocks of that many rows from row 0), a
    chunk is one block, so that the chunks' blocks are the whole weight's."""
    for m in model.modules():
        if isinstance(m, BlockLinear):
            m.kernel = kernel
            if block is not None:
                rows = min(m.out_features, block(m.in_features))
                if rows > m.rows:
                    raise ValueError(f"a scratch of {m.rows} rows holds no block of {rows}")
                m.rows = rows
