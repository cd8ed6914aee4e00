"""Typed wrappers of the `wcodec::` ops, their fake (meta) implementations, the pure-Python
reference with the same semantics, and sample inputs for torch.library.opcheck."""
from __future__ import annotations

import zlib

import numpy as np
import torch

from codec import floatcodec, gguf_blocks, int8, planes, resident
from codec.constants import SEGMENT_SYMBOLS
from codec.floatcodec import FloatParams

from . import fp8
from .plan import BYTES_CODE, DESC_FIELDS, DTYPE_CODES

_LAYOUT_BY_CODE = {code: planes.FLOAT_LAYOUTS[name] for name, code in DTYPE_CODES.items()}
STATUS_DIRECTORY, STATUS_TABLE = 3, 4


BULK, RECORD, INDEXED = 0, 1, 2       # wcodec_constants.h Mode


def decode_pieces(data: torch.Tensor, desc: torch.Tensor, plan: torch.Tensor, outputs: list[torch.Tensor],
                  entry_states: torch.Tensor, entry_words: torch.Tensor, status: torch.Tensor, mode: int,
                  entry_steps: int) -> None:
    """Decode every unit of the float tensors in `desc` (CPU int64 [n, 9], plan.DESC_FIELDS) from
    the uint8 `data` into `outputs` (caller-owned, contiguous, on data's device), on the current
    stream, allocating nothing. `plan` is desc's device plan (plan.device_plan; ignored on the CPU).
    mode BULK decodes whole segments, RECORD also writes the resident index (entry_states int32
    [entries * 32], entry_words int32 [entries]) every entry_steps steps, INDEXED decodes pieces
    of entry_steps steps from it (codec/resident.py). `status` (int32) gets one code per segment
    (per piece for INDEXED), 0 = ok; bad archive data never raises."""
    torch.ops.wcodec.decode_pieces.default(data, desc, plan, outputs, entry_states, entry_words, status,
                                           mode, entry_steps)


def decode_bytes(data: torch.Tensor, desc: torch.Tensor, outputs: list[torch.Tensor], status: torch.Tensor) -> None:
    """Decode byte planes coded alone (desc rows as decode_pieces': ctx_bits 0, dtype plan.BYTES_CODE,
    hi_off = lo_off = -1) from `data` into `outputs` (caller-owned, 1-byte elements, on data's device),
    on the current stream. `status` (int32) gets one code per segment at first_segment + i."""
    torch.ops.wcodec.decode_bytes.default(data, desc, outputs, status)


def dequantize_blocks(planes: list[torch.Tensor], ggml_type: int, outs: list[torch.Tensor]) -> None:
    """GGUF planes (uint8, codec/gguf_blocks.py order) of each tensor of `outs` in turn -> `outs`
    (one dtype: bfloat16, float16 or float32): gguf's dequantization, then torch's CPU cast, bit for
    bit. On CUDA a launch per tensor, on the current stream."""
    torch.ops.wcodec.dequantize_blocks.default(planes, ggml_type, outs)


def reconstruct_int8(resid: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """An int8-coded weight (codec/int8.py): residual bytes (uint8 [R * C], row-major), tile modes
    (uint8, one per 16x16 tile) and row scales (float32 [R]) -> `out` ([R, C] bfloat16, float16 or
    float32): float32(q) * scale, cast as torch's CPU cast does."""
    torch.ops.wcodec.reconstruct_int8.default(resid, modes, scales, out)


def crc32_spans(data: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """zlib.crc32 of each span of the uint8 `data` (1-D, on any device): `spans` is a CPU int64
    tensor [n, 2] of (offset, length). Returns int64 [n] on data's device, computed on the
    current stream (crc32.h: pieces of 256 bytes folded in parallel)."""
    return torch.ops.wcodec.crc32_spans.default(data, spans)


def fixedrate_encode(w: torch.Tensor) -> list[torch.Tensor]:
    """A contiguous 2-D 16-bit weight -> the fixed-rate form's arrays (codec/fixedrate.py), on w's
    device: [plane uint8, lo int32, hi int32, tile int16, esc int16, esc_start int32]. One host
    sync (the escape count)."""
    return torch.ops.wcodec.fixedrate_encode.default(w)


def fixedrate_decode(plane: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tile: torch.Tensor, esc: torch.Tensor,
                     esc_start: torch.Tensor, cols: int, out: torch.Tensor) -> None:
    """The fixed-rate form -> its exact 16-bit words in `out` ([rows, cols], contiguous), on the
    current stream (the kernel's decode steps, written out: the bit-exact test's entry point)."""
    torch.ops.wcodec.fixedrate_decode.default(plane, lo, hi, tile, esc, esc_start, cols, out)


def fixedrate_linear(x: torch.Tensor, plane: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tile: torch.Tensor,
                     esc: torch.Tensor, esc_start: torch.Tensor, cols: int, kernel: int = 0) -> torch.Tensor:
    """y = x W^T, W in the fixed-rate form, x [1..64, groups*32] (zero past cols) in W's dtype;
    float32 accumulation, one rounding. On CUDA fused (W decoded in registers), on the current
    stream, no host syncs; on the CPU the reference (decode, float32 matmul). kernel 0: tensor
    cores (mma, 1..64 rows; the default's choice at every row count since 2026-11-28), 1: CUDA
    cores (1..16 rows)."""
    return torch.ops.wcodec.fixedrate_linear.default(x, plane, lo, hi, tile, esc, esc_start, cols, kernel)


def fixedrate_linear_permuted(xp: torch.Tensor, rows: int, plane: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                              tile: torch.Tensor, esc: torch.Tensor, esc_start: torch.Tensor, cols: int) -> torch.Tensor:
    """fixedrate_linear (tensor cores) of `rows` rows of x (7..64) handed over already in the layout
    the kernel reads at that row count (cuda_ext.fixedrate.PermutedX), so the op launches no permute
    of its own: the same y, bit for bit. On the CPU x is put back in place, then the reference."""
    return torch.ops.wcodec.fixedrate_linear_permuted.default(xp, rows, plane, lo, hi, tile, esc, esc_start, cols)


def fixedrate_permuted_index(rows: int, cols: int) -> torch.Tensor:
    """The fused kernel's x layout for `rows` rows (7..64) of `cols` columns, on the CPU: int64
    [layout rows, layout columns], element (r, c) of x (zero-padded) at that index of the layout's
    flat buffer (cuda_ext/csrc/fixedrate_host.h fr_permuted_at)."""
    return torch.ops.wcodec.fixedrate_permuted_index.default(rows, cols)


FIXEDRATE_OPS = ("wcodec::fixedrate_encode", "wcodec::fixedrate_decode", "wcodec::fixedrate_linear",
                 "wcodec::fixedrate_linear_permuted")


def linear16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a contiguous bf16/fp16 weight [N, K] and x [..., K] of its
    dtype, on the CPU (linear16.cpp): exact products summed in float32 in an order that does not
    depend on x's rows (batch invariant), rounded once; only that order differs from PyTorch's."""
    return torch.ops.wcodec.linear16.default(x, weight, bias)


def linear16_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (N and K multiples of 32; an AVX-512 CPU) in the layout linear16
    transposes its blocks into on every call: the same shape and bytes, permuted, for
    `linear16_packed`."""
    return torch.ops.wcodec.linear16_pack.default(weight)


def linear16_loop(dtype: torch.dtype) -> str:
    """The loop linear16 runs for `dtype` in this process (linear16.cpp): "vdpbf16ps" (bf16 on an
    AVX512-BF16 CPU), "fma" (other AVX-512 CPUs; cuda_ext/linear16.py's sums) or "scalar" (no
    AVX-512, or WCODEC_CPU_SIMD=0; the same sums as "fma"). linear16_pack works where it is not "scalar"."""
    return torch.ops.wcodec.linear16_loop.default(dtype)


def linear16_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear16(x, W, bias) bit for bit, from W packed by `linear16_pack`: no transposes per call."""
    return torch.ops.wcodec.linear16_packed.default(x, packed, bias)


LINEAR16_OPS = ("wcodec::linear16",)
PACKED_OPS = ("wcodec::linear16_pack", "wcodec::linear16_packed")
LOOP_OPS = ("wcodec::linear16_loop",)          # no tensor arguments: a kernel for every key


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """step_kernels.add_rms_norm_reference(x, h, weight, eps) bit for bit on the CPU (step_cpu.cpp), x
    [N, E], h and the weight of x's dtype: (x + h, RMSNorm(x + h)). `lanes` (8 or 16): the floats a
    vector of ATen's sum kernel, whose order of sums it follows (step_kernels.norm_lanes)."""
    return torch.ops.wcodec.add_rms_norm.default(x, h, weight, eps, lanes)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """step_kernels.rope_store_reference bit for bit on the CPU: rotary on q and k, k and v into
    their slots of the caches; returns the rotated q [N, H, D] (contiguous)."""
    return torch.ops.wcodec.rope_store.default(q, k, v, cos, sin, k_cache, v_cache, slots)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """paged.Modules.decode_attention bit for bit on the CPU (the same gather and SDPA, in one call):
    q [B, H, D], each row against the first lengths[b] keys of its block table -> [B, H, D]."""
    return torch.ops.wcodec.decode_attention.default(q, k_cache, v_cache, tables, lengths, block_size, scale)


STEP_OPS = ("wcodec::add_rms_norm", "wcodec::rope_store", "wcodec::decode_attention")


def prepare_plane(data: torch.Tensor, dtype: int) -> list[torch.Tensor]:
    """Split a plane's elements (uint8 `data`, 1-D; `dtype` a plan.DTYPE_CODES value, or
    plan.BYTES_CODE for bytes coded whole) and choose its tables, as floatcodec.prepare /
    prepare_bytes do. Returns [choice int64 [3] = (coded, ctx_bits, table_group), freqs int32
    [4 * ceil(n_seg / 4), 256] (the first n_tables rows used), hi uint8 [n] (empty for bytes),
    lo uint8 [2n] (float32 only, else empty)], all on data's device."""
    return torch.ops.wcodec.prepare_plane.default(data, dtype)


def prepare_planes(data: list[torch.Tensor], dtypes: list[int]) -> list[torch.Tensor]:
    """prepare_plane of many planes (all on one device) in one call: [choices int64 [k, 3] (row i is
    plane i's choice), then per plane its freqs, hi, lo]. On CUDA one count launch, one wait for
    the counts, and the tables chosen on the host's threads, every (plane, candidate) at once."""
    if not data:                                  # no tensor to dispatch on
        return [torch.zeros(0, 3, dtype=torch.int64)]
    return torch.ops.wcodec.prepare_planes.default(data, dtypes)


def encode_planes(data: list[torch.Tensor], dtypes: list[int], freqs: list[torch.Tensor], ctx_bits: list[int],
                  table_groups: list[int]) -> list[torch.Tensor]:
    """rANS-encode planes (as prepare_plane took them) with their tables and parameters: each
    plane's exp stream (uint8, on data's device), byte for byte floatcodec.encode_batch's."""
    return torch.ops.wcodec.encode_planes.default(data, dtypes, freqs, ctx_bits, table_groups)


ENCODE_OPS = ("wcodec::prepare_plane", "wcodec::prepare_planes", "wcodec::encode_planes")
QUANT_OPS = ("wcodec::decode_bytes", "wcodec::dequantize_blocks", "wcodec::reconstruct_int8")
CHECKSUM_OPS = ("wcodec::crc32_spans",)
HOST_ROWS_OPS = ("wcodec::gather_host_rows",)


def gather_host_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """Rows `ids` (int64 [N]) of `table` ([V, E], contiguous, in host memory) -> `out` ([N, E],
    the table's dtype, on ids' device); an id outside [0, V) gives a row of zeros. On CUDA the
    table stays page-locked on the host and the GPU reads the rows over the bus, on the current
    stream, with no host sync (a captured decode step holds it)."""
    torch.ops.wcodec.gather_host_rows.default(table, ids, out)


def reference_gather_host_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    inside = (ids >= 0) & (ids < table.shape[0])
    rows = table.index_select(0, torch.where(inside, ids, 0).cpu()).to(out.device)
    out.copy_(torch.where(inside[:, None], rows, torch.zeros((), dtype=out.dtype, device=out.device)))


def sample_host_rows_inputs(device: str | torch.device) -> list[tuple]:
    """(table, ids, out) cases: 16-byte rows and odd ones, ids outside the table, none at all."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for (v, e), dtype in (((64, 40), torch.bfloat16), ((33, 7), torch.float16), ((5, 3), torch.float32)):
        table = torch.randint(-2**15, 2**15, (v, e * dtype.itemsize // 2), generator=g, dtype=torch.int16)
        table = table.view(dtype).contiguous()
        table = table.pin_memory() if torch.device(device).type == "cuda" else table
        ids = torch.tensor([0, v - 1, 3 % v, -1, v, 2 % v], dtype=torch.int64, device=device)
        cases.append((table, ids, torch.empty(len(ids), table.shape[1], dtype=dtype, device=device)))
    cases.append((cases[0][0], cases[0][1][:0], cases[0][2][:0]))
    return cases


def has_ops(ops: tuple[str, ...], device_type: str | None = None) -> bool:
    """`ops` are registered (for `device_type`'s dispatch key, if given): an extension built
    before an op was added lacks it."""
    if not all(torch._C._dispatch_has_kernel(op) for op in ops):
        return False
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(device_type)
    return key is None or all(torch._C._dispatch_has_kernel_for_dispatch_key(op, key) for op in ops)


def has_quant_ops(device_type: str | None = None) -> bool:
    return has_ops(QUANT_OPS, device_type)


def register_fakes() -> None:
    """Meta implementations for torch.compile / opcheck; called once the library is loaded."""
    if getattr(register_fakes, "done", False):
        return

    @torch.library.register_fake("wcodec::decode_pieces")
    def _(data, desc, plan, outputs, entry_states, entry_words, status, decode_mode, entry_steps):
        return None

    if has_quant_ops():                 # an extension built before them lacks them: NumPy decodes those
        torch.library.register_fake("wcodec::decode_bytes")(lambda data, desc, outputs, status: None)
        torch.library.register_fake("wcodec::dequantize_blocks")(lambda planes, ggml_type, outs: None)
        torch.library.register_fake("wcodec::reconstruct_int8")(lambda resid, modes, scales, out: None)
    if has_ops(HOST_ROWS_OPS):
        torch.library.register_fake("wcodec::gather_host_rows")(lambda table, ids, out: None)
    if has_ops(CHECKSUM_OPS):
        torch.library.register_fake("wcodec::crc32_spans")(
            lambda data, spans: data.new_empty(spans.shape[0], dtype=torch.int64))

    if has_ops(FIXEDRATE_OPS):
        _register_fixedrate_fakes()
    if has_ops(fp8.FP8_OPS):
        fp8.register_fakes()
    if has_ops(LINEAR16_OPS):
        torch.library.register_fake("wcodec::linear16")(
            lambda x, weight, bias=None: x.new_empty(*x.shape[:-1], weight.shape[0]))
    if has_ops(PACKED_OPS):
        torch.library.register_fake("wcodec::linear16_packed")(
            lambda x, packed, bias=None: x.new_empty(*x.shape[:-1], packed.shape[0]))
        torch.library.register_fake("wcodec::linear16_pack")(lambda weight: torch.empty_like(weight))
    if has_ops(STEP_OPS):
        torch.library.register_fake("wcodec::add_rms_norm")(
            lambda x, h, weight, eps, lanes: (torch.empty_like(x), torch.empty_like(x)))
        torch.library.register_fake("wcodec::rope_store")(
            lambda q, k, v, cos, sin, k_cache, v_cache, slots: q.new_empty(q.shape))
        torch.library.register_fake("wcodec::decode_attention")(
            lambda q, k_cache, v_cache, tables, lengths, block_size, scale: q.new_empty(q.shape))
    if has_ops(ENCODE_OPS):
        torch.library.register_fake("wcodec::prepare_plane")(_fake_prepare_plane)
        torch.library.register_fake("wcodec::prepare_planes")(_fake_prepare_planes)
        torch.library.register_fake("wcodec::encode_planes")(_fake_encode_planes)

    register_fakes.done = True


def _register_fixedrate_fakes() -> None:
    @torch.library.register_fake("wcodec::fixedrate_encode")
    def _(w):
        rows, groups = w.shape[0], -(-w.shape[1] // 32)
        tiles, blocks = -(-groups // 4), -(-groups // 32)
        n_esc = torch.library.get_ctx().new_dynamic_size()
        u8, i16, i32 = dict(dtype=torch.uint8), dict(dtype=torch.int16), dict(dtype=torch.int32)
        return [w.new_empty(rows, groups * 32, **u8), w.new_empty(rows, groups * 2, **i32),
                w.new_empty(rows, groups, **i32), w.new_empty(rows, tiles, **i16), w.new_empty(n_esc, **i16),
                w.new_empty(rows, blocks, **i32)]

    torch.library.register_fake("wcodec::fixedrate_decode")(lambda plane, lo, hi, tile, esc, esc_start, cols, out: None)
    torch.library.register_fake("wcodec::fixedrate_linear")(
        lambda x, plane, lo, hi, tile, esc, esc_start, cols, kernel=0: x.new_empty(x.shape[0], plane.shape[0]))
    torch.library.register_fake("wcodec::fixedrate_linear_permuted")(
        lambda xp, rows, plane, lo, hi, tile, esc, esc_start, cols: xp.new_empty(rows, plane.shape[0]))


def _fake_prepare_plane(data, dtype):
    n = data.shape[0] // (4 if dtype == DTYPE_CODES["float32"] else 1 if dtype == BYTES_CODE else 2)
    tables = 4 * -(-(-(-n // SEGMENT_SYMBOLS)) // 4)
    return [data.new_empty(3, dtype=torch.int64), data.new_empty((tables, 256), dtype=torch.int32),
            data.new_empty(0 if dtype == BYTES_CODE else n), data.new_empty(2 * n if dtype == DTYPE_CODES["float32"] else 0)]


def _fake_prepare_planes(data, dtypes):
    per_plane = [_fake_prepare_plane(d, code)[1:] for d, code in zip(data, dtypes)]
    return [torch.empty(len(data), 3, dtype=torch.int64, device=data[0].device if data else "cpu")] + \
        [t for ts in per_plane for t in ts]


def _fake_encode_planes(data, dtypes, freqs, ctx_bits, table_groups):
    ctx = torch.library.get_ctx()
    return [d.new_empty(ctx.new_dynamic_size()) for d in data]


def _plane_words(data: torch.Tensor, dtype: int) -> tuple[planes.FloatLayout | None, np.ndarray]:
    if dtype == BYTES_CODE:
        return None, data.numpy()
    layout = _LAYOUT_BY_CODE[dtype]
    return layout, data.numpy().view(layout.word)


def reference_prepare_plane(data: torch.Tensor, dtype: int) -> list[torch.Tensor]:
    """The NumPy reference of prepare_plane (floatcodec.prepare / prepare_bytes; CPU tensors)."""
    layout, u = _plane_words(data, dtype)
    p = floatcodec.prepare_bytes(u) if layout is None else floatcodec.prepare(layout, u)
    out = _fake_prepare_plane(data, dtype)
    out[0].zero_(), out[1].zero_()
    if layout is not None:
        _, hi, lo = planes.split(layout, u)
        out[2].copy_(torch.from_numpy(hi))
        if lo is not None:
            out[3].copy_(torch.from_numpy(lo.view(np.uint8)))
    if p is not None:
        out[0].copy_(torch.tensor([1, p.params.ctx_bits, p.params.table_group]))
        out[1][:len(p.freqs)] = torch.from_numpy(p.freqs.astype(np.int32))
    return out


def reference_prepare_planes(data: list[torch.Tensor], dtypes: list[int]) -> list[torch.Tensor]:
    """The NumPy reference of prepare_planes: reference_prepare_plane of each plane."""
    each = [reference_prepare_plane(d, code) for d, code in zip(data, dtypes)]
    return [torch.stack([e[0] for e in each]) if each else torch.zeros(0, 3, dtype=torch.int64)] + \
        [t for e in each for t in e[1:]]


def reference_encode_planes(data: list[torch.Tensor], dtypes: list[int], freqs: list[torch.Tensor],
                            ctx_bits: list[int], table_groups: list[int]) -> list[torch.Tensor]:
    """The NumPy reference of encode_planes (floatcodec.encode_batch; CPU tensors)."""
    batch = []
    for d, code, f, cb, g in zip(data, dtypes, freqs, ctx_bits, table_groups):
        layout, u = _plane_words(d, code)
        sym, hi, _ = (u, None, None) if layout is None or layout.itemsize == 1 else planes.split(layout, u)
        params = FloatParams(len(u), cb, min(g, -(-len(u) // SEGMENT_SYMBOLS)))
        batch.append(floatcodec.Prepared(layout, params, f[:params.n_tables].numpy().astype(np.uint32), sym, hi, None))
    return [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in floatcodec.encode_batch(batch)]


def sample_encode_inputs(device: str | torch.device) -> list[tuple]:
    """prepare_plane arguments of every dtype code (one multi-segment, one partial), and one
    encode_planes call over all of them (its freqs from the reference's prepare)."""
    g = torch.Generator().manual_seed(1)
    planes_in = [((torch.randn(SEGMENT_SYMBOLS + 999, generator=g) * 0.02).bfloat16(), DTYPE_CODES["bfloat16"]),
                 ((torch.randn(5000, generator=g) * 3).half(), DTYPE_CODES["float16"]),
                 (torch.randn(70, 90, generator=g), DTYPE_CODES["float32"]),
                 ((torch.rand(9000, generator=g) ** 4 * 255).to(torch.uint8), BYTES_CODE)]
    prepared = [(t.reshape(-1).view(torch.uint8).to(device), code) for t, code in planes_in]
    chosen = [reference_prepare_plane(d.cpu(), code) for d, code in prepared]
    encode = ([d for d, _ in prepared], [c for _, c in prepared], [ch[1].to(device) for ch in chosen],
              [int(ch[0][1]) for ch in chosen], [int(ch[0][2]) for ch in chosen])
    return prepared, encode


def _tensor_items(buf: np.ndarray, row: list[int]):
    """(parsed exp | StreamFault, layout, hi, lo) of one descriptor row."""
    d = dict(zip(DESC_FIELDS, row))
    layout = _LAYOUT_BY_CODE[d["dtype"]]
    params = FloatParams(d["numel"], d["ctx_bits"], d["table_group"], SEGMENT_SYMBOLS)
    hi = buf[d["hi_off"]:d["hi_off"] + d["numel"]]
    lo = buf[d["lo_off"]:d["lo_off"] + 2 * d["numel"]].view("<u2") if d["lo_off"] >= 0 else None
    try:
        parsed = floatcodec.parse_exp(buf[d["exp_off"]:d["exp_off"] + d["exp_len"]], params)
    except floatcodec.StreamFault as fault:
        parsed = fault
    return d, parsed, layout, hi, lo


def reference_decode_pieces(data: torch.Tensor, desc: torch.Tensor, plan: torch.Tensor, outputs: list[torch.Tensor],
                            entry_states: torch.Tensor, entry_words: torch.Tensor, status: torch.Tensor, mode: int,
                            entry_steps: int) -> None:
    """The NumPy reference (codec/) behind the op's interface: CPU tensors only."""
    buf, st = data.numpy(), status.numpy()
    per = resident.pieces_per_segment(entry_steps) if mode != BULK else 1
    states = entry_states.numpy().view(np.uint32).reshape(-1, 32) if mode != BULK else None
    words = entry_words.numpy().view(np.uint32) if mode != BULK else None
    for row, out in zip(desc.tolist(), outputs):
        d, parsed, layout, hi, lo = _tensor_items(buf, row)
        n_seg = -(-d["numel"] // SEGMENT_SYMBOLS)
        first = d["first_segment"] * (per if mode == INDEXED else 1)
        units = slice(first, first + n_seg * (per if mode == INDEXED else 1))
        if isinstance(parsed, floatcodec.StreamFault):
            st[units] = STATUS_TABLE if parsed.table else STATUS_DIRECTORY
            continue
        entries = slice(d["first_segment"] * per, (d["first_segment"] + n_seg) * per)
        if mode == INDEXED:
            index = resident.Index(entry_steps, states[entries], words[entries])
            (sym, st[units]), = resident.decode_pieces([(parsed, layout, hi, index, np.arange(n_seg * per))])
        elif mode == RECORD:
            ((res, index),) = resident.build([(parsed, layout, hi)], entry_steps)
            sym, st[units], states[entries], words[entries] = res.symbols, res.status, index.states, index.words
        else:
            (sym, st[units], _, _), = floatcodec.decode_batch([(parsed, layout, hi)])
        planes.join(layout, sym, hi, lo, out=out.view(-1).view(_word_dtype(layout)).numpy())


def reference_decode_bytes(data: torch.Tensor, desc: torch.Tensor, outputs: list[torch.Tensor],
                           status: torch.Tensor) -> None:
    """The NumPy reference of decode_bytes: every row's segments in one rans.decode pass."""
    buf, st = data.numpy(), status.numpy()
    items, where = [], []
    for row, out in zip(desc.tolist(), outputs):
        d = dict(zip(DESC_FIELDS, row))
        params = FloatParams(d["numel"], 0, d["table_group"], SEGMENT_SYMBOLS)
        segs = slice(d["first_segment"], d["first_segment"] + params.n_segments)
        try:
            items.append((floatcodec.parse_exp(buf[d["exp_off"]:d["exp_off"] + d["exp_len"]], params), None, None))
        except floatcodec.StreamFault as fault:
            st[segs] = STATUS_TABLE if fault.table else STATUS_DIRECTORY
            continue
        where.append((segs, out))
    for (sym, seg_status, _, _), (segs, out) in zip(floatcodec.decode_batch(items) if items else [], where):
        st[segs] = seg_status
        out.reshape(-1).view(torch.uint8).numpy()[:] = sym


def reference_dequantize_blocks(planes: list[torch.Tensor], ggml_type: int, outs: list[torch.Tensor]) -> None:
    """The NumPy reference of dequantize_blocks: gguf_blocks.join, then gguf's own dequantizer."""
    bt = next(t for t in gguf_blocks.BLOCK_TYPES.values() if t.code == ggml_type)
    n = len(bt.plane_names)
    for t, out in enumerate(outs):
        n_blocks = out.numel() // bt.block_size
        if n_blocks == 0:                                    # gguf's dequantizer refuses empty input
            continue
        mine = {name: p.numpy() for name, p in zip(bt.plane_names, planes[t * n:(t + 1) * n])}
        out.copy_(gguf_blocks.dequantize(bt, gguf_blocks.join(bt, mine, n_blocks), tuple(out.shape), out.dtype))


def reference_reconstruct_int8(resid: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The NumPy reference of reconstruct_int8 (codec/int8.py)."""
    rows, cols = out.shape
    tiles = (-(-rows // int8.TILE), -(-cols // int8.TILE))
    q = int8.reconstruct(resid.numpy().reshape(rows, cols), modes.numpy().reshape(tiles))
    out.copy_(int8.dequantize(q, scales.numpy(), out.dtype))


def reference_crc32_spans(data: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """The reference of crc32_spans: zlib, span by span (CPU tensors only)."""
    buf = data.numpy()
    return torch.tensor([zlib.crc32(buf[off:off + n]) for off, n in spans.tolist()], dtype=torch.int64)


def _word_dtype(layout: planes.FloatLayout) -> torch.dtype:
    return torch.int32 if layout.itemsize == 4 else torch.int16


def sample_inputs(device: str | torch.device) -> list[tuple]:
    """Small archives' worth of op arguments (every dtype, multi-segment, a partial segment), in
    each mode; the INDEXED call reads the index that the RECORD call before it writes."""
    from codec.encode import encode_tensors
    from .plan import build, buffers, device_plan, outputs as plan_outputs
    from codec.entries import TensorEntry
    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(SEGMENT_SYMBOLS + 999, generator=g).bfloat16(),
               "fp16": (torch.randn(5000, generator=g) * 3).half(),
               "fp32": torch.randn(70, 90, generator=g)}
    recs = encode_tensors([(n, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[n], tuple(t.shape),
                            t.reshape(-1).view(torch.uint8).numpy()) for n, t in tensors.items()])
    blob, entries = bytearray(), []
    for rec in recs:
        streams = {}
        for role, b in rec["streams"].items():
            streams[role] = {"offset": len(blob), "length": len(b), "crc32": 0}
            blob += bytes(b) + b"\0" * (-len(b) % 64)
        entries.append(TensorEntry(rec["name"], rec["dtype"], tuple(rec["shape"]), rec["codec"], None,
                                   rec["nbytes"], rec["crc32"], streams,
                                   FloatParams(int(np.prod(rec["shape"])), **rec["params"])))
    p = build(entries, start=0, end=len(blob))
    data = torch.frombuffer(blob, dtype=torch.uint8).clone().to(device)
    _, states, words = buffers(p, data.device, RECORD, 256)
    args = []
    for mode, steps in ((BULK, 0), (RECORD, 256), (INDEXED, 256)):
        outputs = plan_outputs(p, device)
        status = buffers(p, data.device, mode, steps)[0]
        args.append((data, p.desc, device_plan(p, outputs, mode, steps), outputs, states, words, status, mode, steps))
    return args, tensors
