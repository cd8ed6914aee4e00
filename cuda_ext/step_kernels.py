"""The decode step's small kernels in Triton (issue 23), each beside the PyTorch reference it
replaces: a residual add fused with RMSNorm, rotary embedding fused with the KV cache write,
attention of one query per row over a paged KV cache, and SiLU(gate) * up. On an H100 a 7B
decode step was ~40 launches a layer, a third of its time outside the matmuls
(docs/BENCHMARKS.md); these make it ~10.

Read me first.
* Each kernel rounds where its reference rounds: every product or sum that PyTorch rounds to the
  activations' dtype (bf16, fp16) is rounded here too, so rotary and SiLU * up give the
  reference's bits, and RMSNorm and attention differ only where a float32 reduction adds in
  another order (the mean of squares; attention's dot products and softmax): the last bf16 place
  at most (tests/gpu/test_step_kernels.py checks each against its reference).
* The kernels (step_triton.py) know nothing of layers or models; `triton_kernels(device)` gives
  them on CUDA when triton imports (not with WCODEC_TRITON=0), and service/model/paged.py decides
  which a layer calls. The references here are the kernels' specification and tests' oracle.
* On the CPU, `cpu_kernels(device)` gives csrc/step_cpu.cpp's twins, which round and sum as the
  references do, bit for bit (the CPU engine's tokens are compared with the padded engine's).
* Every launch is capturable in a CUDA graph: shapes come from the arguments, lengths and block
  tables are read on the device.

    x, h [N, E]   q [N, H, D]   k, v [N, KV, D]   cos, sin [N, D] (sin: first half negated)
    k_cache, v_cache [slots, KV, D]   slots [N]   tables [B, M]   lengths [B]   gate, up [N, F]
"""
from __future__ import annotations

import os
from functools import lru_cache
from types import SimpleNamespace

import torch
import torch.nn.functional as F  # noqa: N812

from . import fixedrate


# ---- the references (PyTorch; service/model/llama.py's maths) -------------------------------------
def add_rms_norm_reference(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, RMSNorm(x + h)): llama.RMSNorm on the residual stream after adding `h` (None: x)."""
    x = x if h is None else x + h
    f = x.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * f.to(x.dtype)


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotary on q and k (`x * cos + x.roll(D/2) * sin`, sin signed), k and v into their slots;
    returns the rotated q [N, H, D]."""
    half = q.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]                                          # [N, 1, D]
    q, k = q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                               lengths: torch.Tensor, block_size: int, scale: float,
                               window: int | None = None) -> torch.Tensor:
    """q [B, H, D]: each row's one query against the first lengths[b] keys of its block table,
    query head h reading KV head h // (H / KV); float32 softmax -> [B, H, D]. With a sliding
    `window`, the query (at position lengths[b] - 1) sees only the keys at positions
    > lengths[b] - 1 - window: the last `window` of them."""
    out = torch.empty_like(q)
    g = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lengths[b])
        pos = torch.arange(max(0, n - window) if window else 0, n, device=q.device)   # [T]
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(g, 1)                        # [T, H, D]
        v = v_cache[slots].float().repeat_interleave(g, 1)
        weights = (torch.einsum("hd,thd->ht", q[b].float(), k) * scale).softmax(-1)   # [H, T]
        out[b] = torch.einsum("ht,thd->hd", weights, v).to(q.dtype)
    return out


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


REFERENCES = SimpleNamespace(add_rms_norm=add_rms_norm_reference, rope_store=rope_store_reference,
                             decode_attention=decode_attention_reference, silu_mul=silu_mul_reference, windows=True)
"""The references as a kernel set: step_triton.py's interface (paged.Fused runs either). `windows`:
decode_attention takes a sliding window (csrc/step_cpu.cpp's op does not: paged.Fused attends
such rows with the modules' SDPA)."""


def cpu_kernels(device: torch.device) -> SimpleNamespace | None:
    """csrc/step_cpu.cpp's ops on the CPU, where they give the references' bits: the extension has
    them and add_rms_norm follows this torch's order of float sums (`norm_lanes`; WCODEC_CPU_STEP=0:
    never). SiLU * up stays the reference; prompts are attended as chunks (SDPA, as the modules
    attend them), not as decode rows. None elsewhere."""
    if device.type != "cpu" or os.environ.get("WCODEC_CPU_STEP", "1") == "0":
        return None
    return _step_cpu()


@lru_cache(maxsize=1)
def _step_cpu() -> SimpleNamespace | None:
    from . import available, ops
    if not available().cpp or not ops.has_ops(ops.STEP_OPS, "cpu") or (lanes := norm_lanes()) is None:
        return None

    def add_rms_norm(x, h, weight, eps):
        if weight.dtype != x.dtype:                # the reference's type promotion: not the op's
            return add_rms_norm_reference(x, h, weight, eps)
        return ops.add_rms_norm(x, h, weight, eps, lanes)
    return SimpleNamespace(add_rms_norm=add_rms_norm, rope_store=ops.rope_store, decode_attention=ops.decode_attention,
                           silu_mul=silu_mul_reference, prompts_as_decode_rows=False)


@lru_cache(maxsize=1)
def norm_lanes() -> int | None:
    """The vector width (floats) of ATen's sum kernel here, which add_rms_norm must repeat: the one of
    8 and 16 whose norms equal the reference's on probe rows (torch 2.13 sums with its AVX2 kernel,
    8, under the AVX512 capability too: sum_stub has no AVX512 kernel); None: neither does."""
    from . import ops
    g = torch.Generator().manual_seed(0)
    probes = [torch.randn(16, n, generator=g) * torch.exp2(torch.randint(-8, 9, (16, n), generator=g).float())
              for n in (576, 1000, 4096)]
    for lanes in (8, 16):
        if all(torch.equal(ops.add_rms_norm(x, None, torch.ones(x.shape[1]), 1e-5, lanes)[1],
                           add_rms_norm_reference(x, None, torch.ones(x.shape[1]), 1e-5)[1]) for x in probes):
            return lanes
    return None


def triton_kernels(device: torch.device):
    """cuda_ext/step_triton.py on CUDA when triton imports (WCODEC_TRITON=0: never); else None."""
    if device.type != "cuda" or os.environ.get("WCODEC_TRITON", "1") == "0":
        return None
    return _step_triton()


@lru_cache(maxsize=1)
def _step_triton():
    try:
        from . import step_triton
    except ImportError:                    # no triton here
        return None
    return step_triton


def warm_up(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, heads: int, kv_heads: int,
            head_dim: int, block_size: int, permuted: bool = False, qk_norm: bool = False) -> bool:
    """Compile (or load from Triton's cache) every variant of the kernels a model's steps take, at
    toy sizes with the model's dimensions, so that no step waits for it: Triton specializes each
    integer argument that is 1 or a multiple of 16, so the block tables come in widths 1, 2, 16
    and 17 (one of more than step_triton.ATTENTION_CHUNK keys, cut into chunks). In a fresh
    process this takes seconds even from Triton's disk cache (H100 box: the first token came
    2.9 s after ready when the first request paid it; the runner now runs it beside serving,
    service/engine/runner.py). `permuted`: also the variants that write x in the fused fixed-rate
    linears' layouts (a model of FixedLinears: one m16 tile, and 3 to 8 n8 tiles). `qk_norm`: also
    RMSNorm over rows of head_dim (a Qwen3's q_norm and k_norm, service/model/paged.py). False where
    no Triton kernels run."""
    kernels = triton_kernels(device)
    if kernels is None:
        return False
    make = lambda *shape: torch.zeros(shape, device=device, dtype=dtype)
    x, w = make(2, hidden), make(hidden)
    kernels.add_rms_norm(x, None, w, 1e-5)
    kernels.add_rms_norm(x, x, w, 1e-5)
    if qk_norm:
        kernels.add_rms_norm(make(2 * heads, head_dim), None, make(head_dim), 1e-5)
    q, k, v = make(2, (heads + 2 * kv_heads) * head_dim).split([heads * head_dim, kv_heads * head_dim,
                                                                 kv_heads * head_dim], 1)
    k_cache, v_cache = make(16 * block_size, kv_heads, head_dim), make(16 * block_size, kv_heads, head_dim)
    slots = torch.zeros(2, dtype=torch.long, device=device)
    kernels.rope_store(q.view(2, heads, head_dim), k.view(2, kv_heads, head_dim), v.view(2, kv_heads, head_dim),
                       make(2, head_dim), make(2, head_dim), k_cache, v_cache, slots)
    for width in (1, 2, 16, 17):                 # 17: a table cut into chunks (step_triton.ATTENTION_CHUNK)
        tables = torch.zeros(2, width, dtype=torch.long, device=device)
        kernels.decode_attention(make(2, heads, head_dim), k_cache, v_cache, tables, slots + 1, block_size,
                                 head_dim ** -0.5)
    gate_up = make(2, 2 * intermediate)
    kernels.silu_mul(gate_up[:, :intermediate], gate_up[:, intermediate:])
    for rows in (7, *range(24, 65, 8)) if permuted else ():             # one m16 tile, n8 tiles 3..8
        x, gate_up = make(rows, hidden), make(rows, 2 * intermediate)
        with fixedrate.fused_rows(fixedrate.FUSED_MAX_ROWS):
            at = fixedrate.permuted_rows(rows)
            for h in (None, x):
                kernels.add_rms_norm(x, h, w, 1e-5, at, fixedrate.permuted_cols(hidden))
            kernels.silu_mul(gate_up[:, :intermediate], gate_up[:, intermediate:], at,
                             fixedrate.permuted_cols(intermediate))
    torch.cuda.synchronize(device)
    return True
