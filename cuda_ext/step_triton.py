"""Triton kernels of the decode step; their references and the rules they keep are in
step_kernels.py (read that first). Each wrapper checks what a caller can get wrong, allocates its
outputs, and launches on the current stream.

`_round(x, dtype)`: a float32 value rounded to the activations' dtype and widened back, as
PyTorch rounds each elementwise op's result; the kernels call it wherever the reference rounds.
For bf16 it rounds the bits itself (to nearest, ties to even): a float -> bf16 -> float
conversion pair was seen to vanish on an H100 (a product then fused into the next add), which
left rotary one bf16 place off the reference.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


# ---- programmatic dependent launch ---------------------------------------------------------------
# On sm_90+ every kernel here is launched with PDL: it waits for the kernel ahead at its start
# (before any load or store) and at once lets the next one launch, so the fused linears that follow
# request their first tiles of W while it runs (cuda_ext/csrc/fixedrate_mma.cuh).
@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    """NVIDIA sm_90+ with a Triton that has gdc_wait (ROCm reports MI300 as capability 9.4: no PDL there)."""
    return (torch.version.hip is None and hasattr(tl.extra.cuda, "gdc_wait")
            and torch.cuda.get_device_capability(index)[0] >= 9)


def _pdl(t: torch.Tensor) -> dict:
    """The launch's PDL arguments for kernels on t's device: GDC (the kernel's constexpr) and launch_pdl."""
    on = t.is_cuda and _pdl_device(t.device.index)                      # a CUDA tensor's index is set
    return {"GDC": True, "launch_pdl": True} if on else {"GDC": False}


@triton.jit
def _pdl_enter(GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _round(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:                                             # keep the top 16 bits, rounded
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


# ---- where a linear's x goes ---------------------------------------------------------------------
# A kernel whose output is x of a fused fixed-rate linear (cuda_ext.fixedrate) may write it in the
# layout that linear's kernel reads at that row count, so that it launches no permute of x: the
# served step 1.5-3.4 % faster at 8-32 rows (H200, 2026-11-30). `permuted`: the layout's rows
# (fixedrate.permuted_rows: 16 for one m16 tile, else whole n8 tiles; 0 row-major), `width` its
# columns; rows past x's and columns past its own are written as zeros.
def _layout(n: int, permuted: int) -> int:
    """The kernels' LAYOUT: 0 row-major, -1 one m16 tile (7-16 rows), else the n8 tiles."""
    return 0 if not permuted else -1 if n <= 16 else permuted // 8


@triton.jit
def _x_at(row, c, cols, LAYOUT: tl.constexpr):
    """Where element (row, c) of x goes (cuda_ext/csrc/fixedrate_host.h fr_permuted_at)."""
    if LAYOUT == 0:
        at = row * cols + c
    else:
        pw = c // 2
        gr = pw // 16
        pp = pw % 16
        lane = (row % 8) * 4 + gr % 4
        q = (gr // 4) * 8 + pp // 2
        if LAYOUT < 0:                                                   # [tiles][8 q][32 lanes] of 4 words
            at = 2 * (4 * (q * 32 + lane) + (pp % 2) * 2 + row // 8) + c % 2
        else:                                                            # [tiles][8 q][LAYOUT j][32 lanes] of 2 words
            at = 2 * (2 * ((q * LAYOUT + row // 8) * 32 + lane) + pp % 2) + c % 2
    return at


# ---- RMSNorm on the residual stream --------------------------------------------------------------
@triton.jit(do_not_specialize=["rows"])                                  # rows: the step's, any count
def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, rows, cols, width, eps, HAS_H: tl.constexpr,
                         BLOCK: tl.constexpr, LAYOUT: tl.constexpr, GDC: tl.constexpr):
    _pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = (c < cols) & (row < rows)                                   # rows past x's: the layout's zeros
    x = tl.load(x_ptr + row * cols + c, mask=inside, other=0.0).to(tl.float32)
    if HAS_H:                                                            # x + h, rounded
        h = tl.load(h_ptr + row * cols + c, mask=inside, other=0.0).to(tl.float32)
        x = _round(x + h, sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * cols + c, x.to(sum_ptr.dtype.element_ty), mask=inside)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / cols + eps)             # rsqrt(mean(x^2) + eps)
    normed = _round(x * inv, sum_ptr.dtype.element_ty)                   # f.to(x.dtype)
    w = tl.load(w_ptr + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + _x_at(row, c, cols, LAYOUT),
             _round(w * normed, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=c < width)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float, permuted: int = 0,
                 width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x, h [N, E] contiguous -> (x + h, RMSNorm(x + h) * weight); h None: (x, RMSNorm(x)). The
    second [N, E], or with `permuted` rows ([permuted, width]) in a fused linear's layout (above)."""
    n, e = x.shape
    torch._check(x.is_contiguous() and (h is None or (h.is_contiguous() and h.shape == x.shape)),
                 lambda: "add_rms_norm: x and h must be contiguous [N, E] of one shape")
    torch._check(not permuted or (permuted >= n and width >= e), lambda: "add_rms_norm: a layout smaller than x")
    total = x if h is None else torch.empty_like(x)
    out = torch.empty((permuted or n, width or e), dtype=torch.result_type(weight, x), device=x.device)
    block = triton.next_power_of_2(width or e)
    _add_rms_norm_kernel[(permuted or n,)](x, x if h is None else h, weight, total, out, n, e, width or e, eps,
                                           HAS_H=h is not None, BLOCK=block, LAYOUT=_layout(n, permuted),
                                           num_warps=8 if block >= 4096 else 4, **_pdl(x))
    return total, out


# ---- rotary embedding and the KV cache write -----------------------------------------------------
@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr, qo_ptr,
                       q_row, k_row, v_row, heads, kv_heads, D: tl.constexpr, GDC: tl.constexpr):
    _pdl_enter(GDC)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    rolled = (d + D // 2) % D                                            # x.roll(D/2)[d] = x[(d - D/2) mod D]
    cos = tl.load(cos_ptr + t * D + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * D + d).to(tl.float32)                    # signed
    dtype = qo_ptr.dtype.element_ty
    if head < heads:
        src = q_ptr + t * q_row + head * D
        x, xr = tl.load(src + d).to(tl.float32), tl.load(src + rolled).to(tl.float32)
        y = _round(_round(x * cos, dtype) + _round(xr * sin, dtype), dtype)
        tl.store(qo_ptr + (t * heads + head) * D + d, y.to(dtype))
    else:
        j = head - heads
        slot = tl.load(slots_ptr + t)
        src = k_ptr + t * k_row + j * D
        x, xr = tl.load(src + d).to(tl.float32), tl.load(src + rolled).to(tl.float32)
        y = _round(_round(x * cos, dtype) + _round(xr * sin, dtype), dtype)
        tl.store(kc_ptr + (slot * kv_heads + j) * D + d, y.to(dtype))
        tl.store(vc_ptr + (slot * kv_heads + j) * D + d, tl.load(v_ptr + t * v_row + j * D + d))


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q [N, H, D], k, v [N, KV, D] (rows may be strided: views of one projection), cos, sin [N, D]
    -> rotated q [N, H, D]; rotated k and v written to k_cache, v_cache [slots, KV, D] at `slots`."""
    n, heads, d = q.shape
    kv = k.shape[1]
    torch._check(q.stride()[1:] == (d, 1) and k.stride()[1:] == (d, 1) and v.stride()[1:] == (d, 1)
                 and cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous()
                 and v_cache.is_contiguous() and d == triton.next_power_of_2(d),
                 lambda: "rope_store: heads must be dense, caches contiguous, head_dim a power of 2")
    out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    if n:
        _rope_store_kernel[(n, heads + kv)](q, k, v, cos, sin, slots, k_cache, v_cache, out, q.stride(0),
                                            k.stride(0), v.stride(0), heads, kv, D=d, num_warps=1, **_pdl(q))
    return out


# ---- attention of one query a row over a paged KV cache ------------------------------------------
# A row's keys are cut into chunks of CHUNK keys (split-K, FlashDecoding's): program (b, head, s)
# takes chunk s and leaves its running max, sum and weighted values in a float32 workspace, which
# _attention_combine_kernel merges in chunk order. So a step's attention no longer waits on one
# serial loop over the whole context (a load of the block table, then of K and V, each turn): one
# row of 2 048 keys 226 -> 15.5 us a layer, 32 rows of 2 048 483 -> 275 us (H200, 2026-11-28,
# bench/decode_attention.py). The cut depends on the key positions alone, not on the batch: a row
# gets the same output in any batch. A step whose table holds at most CHUNK keys a row launches
# the first kernel alone (SPLIT False), which then writes the output itself: bit for bit what the
# combine of its one chunk gives. One turn of BLOCK_N keys a program, 2 warps, was the fastest of
# the cuts tried (32 to 128 keys a chunk, 16 to 128 a turn, 2 to 8 warps): two turns a program
# left the turns' loads in series.
# GQA (query heads sharing a KV head) takes _decode_attention_group_kernel: program (b, kv head, s)
# attends the group's query heads at once, both products as tensor-core dots over 16 rows (the
# group's, zeros past it), so K and V are read once a group instead of once a query head: 32 query
# heads over 8 KV heads, 32 rows of 2 048 keys 173 -> 87.6 us, 64 of 8 192 1 363 -> 644 us, one of
# 8 192 37.8 -> 26.0 us; 72 keys a row 5.03 -> 5.15 us at one row (H200, 2026-11-28). P.V takes
# P as two bf16 parts (hi + lo: 16 bits of it): P rounded to bf16 was 3 % faster, but 35 % of the
# outputs left the per-head kernel's bits (0.2 % this way, by one place: the order of the sums), and
# tf32x3 on float32 P was no faster than the per-head kernel.
ATTENTION_CHUNK = 64                                                     # keys a program (a multiple of the next)
ATTENTION_BLOCK = 64                                                     # keys a turn of its loop
ATTENTION_WARPS = 2
ATTENTION_GROUPED = True                                                 # GQA: a KV head's query heads a program
ATTENTION_GROUP_WARPS = 4


@triton.jit(do_not_specialize=["window"])
def _decode_attention_kernel(q_ptr, kc_ptr, vc_ptr, tables_ptr, lengths_ptr, out_ptr, part_ptr, scale, width,
                             heads, kv_heads, window, BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                             CHUNK: tl.constexpr, SPLIT: tl.constexpr, GDC: tl.constexpr):
    _pdl_enter(GDC)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kvh = head // (heads // kv_heads)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * heads + head) * D + d).to(tl.float32)
    length = tl.load(lengths_ptr + b)
    first = tl.maximum(length - window, 0)                               # the window's first key position
    if SPLIT:                                                            # chunk s of the row's keys
        lo = tl.maximum(tl.program_id(2) * CHUNK, first)                 # (none where it ends before `first`)
        hi = tl.minimum(length, tl.program_id(2) * CHUNK + CHUNK)
    else:
        lo, hi = first, length
    best = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)     # running max of the scores
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)                  # running sum of exp(s - best)
    acc = tl.zeros([D], tl.float32)                                          # running sum of exp(s - best) * v
    for start in range(lo, hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)                                    # key positions
        valid = p < hi
        block = tl.load(tables_ptr + b * width + p // BS, mask=valid, other=0)
        at = ((block * BS + p % BS) * kv_heads + kvh)[:, None] * D + d[None, :]   # [BLOCK_N, D]
        k = tl.load(kc_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        new = tl.maximum(best, tl.max(s, axis=0))
        fade, e = tl.exp(best - new), tl.exp(s - new)
        total = total * fade + tl.sum(e, axis=0)
        acc = acc * fade + tl.sum(e[:, None] * v, axis=0)
        best = new
    if SPLIT:                                                            # [B, H, chunks, D + 2]: acc, max, sum
        chunks = (width * BS + CHUNK - 1) // CHUNK                       # from width: no int argument to specialize
        at = part_ptr + ((b * heads + head) * chunks + tl.program_id(2)) * (D + 2)
        tl.store(at + d, acc)                                            # past the row's keys: never read
        tl.store(at + D, best)
        tl.store(at + D + 1, total)
    else:
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + (b * heads + head) * D + d, _round(acc / total, dtype).to(dtype))


@triton.jit(do_not_specialize=["window"])
def _decode_attention_group_kernel(q_ptr, kc_ptr, vc_ptr, tables_ptr, lengths_ptr, out_ptr, part_ptr, scale, width,
                                   heads, kv_heads, window, BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                   CHUNK: tl.constexpr, SPLIT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                                   GDC: tl.constexpr):
    """_decode_attention_kernel for the G query heads that share KV head program_id(1) (GQA): K and V
    are read once for the group, and both products are tensor-core dots over GP >= 16 rows (rows
    G.. are zeros, never stored), float32 accumulation; q.K's bf16 products are exact in it."""
    _pdl_enter(GDC)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, GP)
    in_group = g < G
    head = kvh * G + g                                                   # [GP]
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * heads + head)[:, None] * D + d[None, :], mask=in_group[:, None], other=0.0)
    length = tl.load(lengths_ptr + b)
    first = tl.maximum(length - window, 0)                               # as _decode_attention_kernel
    if SPLIT:
        lo = tl.maximum(tl.program_id(2) * CHUNK, first)
        hi = tl.minimum(length, tl.program_id(2) * CHUNK + CHUNK)
    else:
        lo, hi = first, length
    best = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        valid = p < hi
        block = tl.load(tables_ptr + b * width + p // BS, mask=valid, other=0)
        at = ((block * BS + p % BS) * kv_heads + kvh)[:, None] * D + d[None, :]   # [BLOCK_N, D]
        k = tl.load(kc_ptr + at, mask=valid[:, None], other=0.0)
        v = tl.load(vc_ptr + at, mask=valid[:, None], other=0.0)
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))   # [GP, BLOCK_N]
        new = tl.maximum(best, tl.max(s, axis=1))
        fade, e = tl.exp(best - new), tl.exp(s - new[:, None])
        total = total * fade + tl.sum(e, axis=1)
        e_hi = e.to(v.dtype)                                             # P as two 16-bit parts (16 bits of it):
        e_lo = (e - e_hi.to(tl.float32)).to(v.dtype)                     # P rounded to bf16 moved 35 % of outputs
        acc = acc * fade[:, None] + tl.dot(e_hi, v) + tl.dot(e_lo, v)    # off the per-head kernel's bits, this 0.2 %
        best = new
    if SPLIT:
        chunks = (width * BS + CHUNK - 1) // CHUNK
        at = part_ptr + ((b * heads + head) * chunks + tl.program_id(2)) * (D + 2)   # [GP]
        tl.store(at[:, None] + d[None, :], acc, mask=in_group[:, None])
        tl.store(at + D, best, mask=in_group)
        tl.store(at + D + 1, total, mask=in_group)
    else:
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + (b * heads + head)[:, None] * D + d[None, :], _round(acc / total[:, None], dtype).to(dtype),
                 mask=in_group[:, None])


@triton.jit(do_not_specialize=["window"])
def _attention_combine_kernel(part_ptr, lengths_ptr, out_ptr, width, heads, window, BS: tl.constexpr, D: tl.constexpr,
                              CHUNK: tl.constexpr, GDC: tl.constexpr):
    _pdl_enter(GDC)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    chunks = (width * BS + CHUNK - 1) // CHUNK
    base = part_ptr + (b * heads + head) * chunks * (D + 2)
    best = tl.max(tl.full([D], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([D], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    length = tl.load(lengths_ptr + b)
    first = tl.maximum(length - window, 0)                               # chunks before the one of key `first`
    for s in range(first // CHUNK, tl.cdiv(length, CHUNK)):              # hold no key: the row's others, in order
        at = base + s * (D + 2)
        m = tl.load(at + D)
        new = tl.maximum(best, m)
        fade, w = tl.exp(best - new), tl.exp(m - new)
        total = total * fade + tl.load(at + D + 1) * w
        acc = acc * fade + tl.load(at + d) * w
        best = new
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + (b * heads + head) * D + d, _round(acc / total, dtype).to(dtype))


WINDOWS = True                       # decode_attention takes a sliding window (paged.Fused)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, block_size: int, scale: float, window: int | None = None) -> torch.Tensor:
    """q [B, H, D] contiguous, caches [slots, KV, D], tables [B, M] int64, lengths [B] int64 (>= 1)
    -> [B, H, D]. A sliding `window`: row b's query (at position lengths[b] - 1) sees the keys at
    positions >= lengths[b] - window (> its position - window, as transformers' mask); None: the
    table's every key (a window longer than any row, so the kernels' first key is 0)."""
    b, heads, d = q.shape
    kv, width = k_cache.shape[1], tables.shape[1]
    window = window or 1 << 30                                           # no window: one no row outgrows
    torch._check(q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                 and tables.is_contiguous() and heads % kv == 0 and d == triton.next_power_of_2(d),
                 lambda: "decode_attention: contiguous inputs, H a multiple of KV, head_dim a power of 2")
    out = torch.empty_like(q)
    if not b:
        return out
    chunks = triton.cdiv(width * block_size, ATTENTION_CHUNK)
    part = torch.empty((b, heads, chunks, d + 2), dtype=torch.float32, device=q.device) if chunks > 1 else out
    group = heads // kv
    if group > 1 and d >= 16 and ATTENTION_GROUPED:                      # GQA: a program a KV head's group
        _decode_attention_group_kernel[(b, kv, chunks)](q, k_cache, v_cache, tables, lengths, out, part, scale, width,
                                                        heads, kv, window, BS=block_size, D=d, BLOCK_N=ATTENTION_BLOCK,
                                                        CHUNK=ATTENTION_CHUNK, SPLIT=chunks > 1, G=group,
                                                        GP=max(16, triton.next_power_of_2(group)),
                                                        num_warps=ATTENTION_GROUP_WARPS, **_pdl(q))
    else:
        _decode_attention_kernel[(b, heads, chunks)](q, k_cache, v_cache, tables, lengths, out, part, scale, width,
                                                     heads, kv, window, BS=block_size, D=d, BLOCK_N=ATTENTION_BLOCK,
                                                     CHUNK=ATTENTION_CHUNK, SPLIT=chunks > 1, num_warps=ATTENTION_WARPS,
                                                     **_pdl(q))
    if chunks > 1:
        _attention_combine_kernel[(b, heads)](part, lengths, out, width, heads, window, BS=block_size, D=d,
                                              CHUNK=ATTENTION_CHUNK, num_warps=1, **_pdl(q))
    return out


# ---- SiLU(gate) * up -----------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rows"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, rows, cols, width, g_row, u_row, BLOCK: tl.constexpr,
                     LAYOUT: tl.constexpr, GDC: tl.constexpr):
    _pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (c < cols) & (row < rows)
    dtype = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * g_row + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row + c, mask=inside, other=0.0).to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), dtype)                          # F.silu, rounded
    tl.store(out_ptr + _x_at(row, c, cols, LAYOUT), _round(silu * u, dtype).to(dtype), mask=c < width)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, permuted: int = 0, width: int = 0) -> torch.Tensor:
    """gate, up [N, F] (rows may be strided: halves of one projection) -> SiLU(gate) * up [N, F], or
    with `permuted` rows ([permuted, width]) in a fused linear's layout (above)."""
    n, f = gate.shape
    torch._check(up.shape == gate.shape and gate.stride(1) == 1 and up.stride(1) == 1 and up.dtype == gate.dtype,
                 lambda: "silu_mul: gate and up of one shape and dtype, dense rows")
    torch._check(not permuted or (permuted >= n and width >= f), lambda: "silu_mul: a layout smaller than x")
    out = torch.empty((permuted or n, width or f), dtype=gate.dtype, device=gate.device)
    block = 1024
    if n:
        _silu_mul_kernel[(permuted or n, triton.cdiv(width or f, block))](
            gate, up, out, n, f, width or f, gate.stride(0), up.stride(0), BLOCK=block, LAYOUT=_layout(n, permuted),
            num_warps=4, **_pdl(gate))
    return out
