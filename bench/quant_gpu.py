"""GPU timing of the quantized codecs' CUDA decoders, each checked bit for bit against the C++ twin.

    python3 bench/quant_gpu.py [--part demo-part.gguf] [--json $OUT/quant_gpu.json] [--copies 8]

Inputs are made on the GPU box (nothing large travels), one Llama-3-8B decoder layer's weights
(q k v o 4096/1024 x 4096, gate up 14336 x 4096, down 4096 x 14336; 218 M weights), trained-like:
N(0, 0.02) with per-row log-normal scales (sigma 0.35) and rare outliers (1e-4 of the weights,
x 8). Each becomes an archive written by our encoder:

    fp8-e4m3 / fp8-e5m2  per-row scaled casts to float8 (codec float, whole byte coded)
    gguf-Q4_1 / Q8_0 / Q4_K   blocks quantized from the weights on the GPU (codec gguf, bf16 out)
    gguf-part        the GGUF blocks of the demo part given by --part (its quantized tensors)
    int8             the int8 codec (lossy) of the weights, bf16 out

For each: the archive's bytes go to the GPU once; cuda_ext.decode_plan on the GPU and on the CPU
(C++ twin) must agree bit for bit. Then --copies copies of the layer are decoded as the codec's
decode runs (decode_bytes over every coded plane of every copy in one launch, then
dequantize_blocks per block type over every copy's tensors, reconstruct_int8 per tensor; fp8
decodes straight into its tensors), timed
with CUDA events: the median of --repeat launches after a warm-up. GB/s counts the decoded output
(the tensors in their dtype). Every timed copy is compared with the checked decode, and every
status must be 0. The acceptance is >= 300 GB/s for each codec.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import cuda_ext  # noqa: E402
from gpu_bench import timed  # noqa: E402  (bench/, this script's folder)
from codec import gguf_blocks  # noqa: E402
from codec.constants import CODEC_FLOAT, CODEC_GGUF, CODEC_INT8  # noqa: E402
from codec.decode import Archive  # noqa: E402
from codec.encode import compress_source  # noqa: E402
from codec.sources import StateDictSource, open_source  # noqa: E402
from cuda_ext import ops, plans, quant  # noqa: E402

LAYER = {"self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (1024, 4096), "self_attn.v_proj": (1024, 4096),
         "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (14336, 4096), "mlp.up_proj": (14336, 4096),
         "mlp.down_proj": (4096, 14336)}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
TARGET_GBPS = 300.0
DEVICE = "cuda"                    # where inputs are made and decoded (a CPU smoke run sets "cpu")


# ---- inputs (made on the GPU) ----------------------------------------------------------------------
def trained_like(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """float32 [R, C] on the GPU: N(0, 0.02) x per-row log-normal scale, 1e-4 outliers x 8."""
    w = torch.randn(shape, generator=g, device=DEVICE) * 0.02
    w *= torch.exp(torch.randn((shape[0], 1), generator=g, device=DEVICE) * 0.35)
    outliers = torch.rand(shape, generator=g, device=DEVICE) < 1e-4
    return torch.where(outliers, w * 8, w)


def layer_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return {f"model.layers.0.{k}.weight": trained_like(s, g) for k, s in LAYER.items()}


def fp8_cast(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scaled cast, as fp8 checkpoints are made: (fp8 weight, float32 scale [R, 1])."""
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX[dtype]).clamp(min=1e-12)
    return (w / scale).to(dtype), scale


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 34]: f16 d = absmax / 127, then int8 round(x / d)."""
    x = w.reshape(-1, 32)
    d = x.abs().amax(1, keepdim=True) / 127
    q = torch.where(d > 0, x / d, torch.zeros_like(x)).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([_f16_bytes(d[:, 0]), q.view(torch.uint8)], 1)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values < 16 -> [..., 16] bytes: weight j in the low nibble of byte j % 16 for j < 16,
    the high nibble for j >= 16 (ggml's qs layout)."""
    return (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 20]: f16 d = (max - min) / 15, f16 m = min, 4-bit round((x - m) / d)."""
    x = w.reshape(-1, 32)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.where(d > 0, (x - lo) / d, torch.zeros_like(x)).round().clamp(0, 15).to(torch.int32)
    return torch.cat([_f16_bytes(d[:, 0]), _f16_bytes(lo[:, 0]), _nibbles(q)], 1)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 144]: per 256 weights f16 d, dmin; 8 sub-blocks of 32 with 6-bit scale and min
    (packed as Q4_K.get_scale_min reads them); y = d * sc * q - dmin * m, q 4-bit."""
    x = w.reshape(-1, 8, 32)
    lo = (-x.amin(2)).clamp(min=0)                                   # [n, 8] sub-block mins (as m >= 0)
    s = (x.amax(2) + lo) / 15
    d, dmin = s.amax(1, keepdim=True) / 63, lo.amax(1, keepdim=True) / 63
    sc = torch.where(d > 0, s / d, torch.zeros_like(s)).round().clamp(0, 63).to(torch.int32)
    m = torch.where(dmin > 0, lo / dmin, torch.zeros_like(lo)).round().clamp(0, 63).to(torch.int32)
    d16, dm16 = d.to(torch.float16).float(), dmin.to(torch.float16).float()
    step = (d16 * sc).unsqueeze(2)
    q = torch.where(step > 0, (x + (dm16 * m).unsqueeze(2)) / step, torch.zeros_like(x)).round().clamp(0, 15)
    q = q.to(torch.int32)
    scales = torch.empty((x.shape[0], 12), dtype=torch.int32, device=w.device)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)    # i < 4: sc; top bits of sc[i + 4]
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)      # i < 4: m; top bits of m[i + 4]
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)    # i >= 4: low bits of sc, m
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)          # byte 32 p + l: sub-blocks 2p, 2p + 1
    return torch.cat([_f16_bytes(d[:, 0]), _f16_bytes(dmin[:, 0]), scales.to(torch.uint8), qs.to(torch.uint8)], 1)


QUANTIZERS = {"Q4_1": quantize_q4_1, "Q8_0": quantize_q8_0, "Q4_K": quantize_q4_k}


class BlocksSource(StateDictSource):
    """Tensors whose blocks go to the encoder as a GGUF file's kept tensors do (codec gguf)."""

    def __init__(self, quantized: dict[str, tuple[gguf_blocks.Blocks, tuple, torch.dtype]]) -> None:
        super().__init__({n: torch.empty(shape, dtype=dt, device="meta") for n, (_, shape, dt) in quantized.items()})
        self._quantized = quantized

    def load_blocks(self, name: str):
        return self._quantized[name][0]


def build_archives(folder: Path, part: Path | None, workers: int) -> dict[str, Path]:
    out, weights = {}, layer_weights(0)
    for tag, dtype in (("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)):
        state = {}
        for name, w in weights.items():
            q, scale = fp8_cast(w, dtype)
            state[name], state[name.replace(".weight", ".weight_scale")] = q.cpu(), scale.cpu()
        out[tag] = _write(folder / f"{tag}.wcodec", StateDictSource(state), workers)
    for kind, quantize in QUANTIZERS.items():
        bt = gguf_blocks.BLOCK_TYPES[kind]
        blocks = {name: (gguf_blocks.Blocks(bt, quantize(w).cpu().numpy()), tuple(w.shape), torch.bfloat16)
                  for name, w in weights.items()}
        out[f"gguf-{kind}"] = _write(folder / f"gguf-{kind}.wcodec", BlocksSource(blocks), workers)
    if part is not None:
        out["gguf-part"] = _write(folder / "gguf-part.wcodec", open_source(part, gguf_keep=True), workers)
    state = {name: w.to(torch.bfloat16).cpu() for name, w in weights.items()}
    out["int8"] = _write(folder / "int8.wcodec", StateDictSource(state), workers, lossy=CODEC_INT8)
    return out


def _write(path: Path, source, workers: int, lossy: str | None = None) -> Path:
    t0 = time.perf_counter()
    with source:
        stats = compress_source(source, path, workers=workers, lossy=lossy)
    print(f"  wrote {path.name}: {stats.tensors} tensors, ratio {stats.ratio:.4f}, {time.perf_counter() - t0:.1f} s",
          flush=True)
    return path


# ---- one codec: check, then time -------------------------------------------------------------------
def is_new_codec(e) -> bool:
    return e.codec in (CODEC_GGUF, CODEC_INT8) or (e.codec == CODEC_FLOAT and e.dtype.startswith("float8"))


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Copies:
    """`copies` decodes of one plan's coded entries, with every buffer allocated up front: run()
    is the codec's decode (one decode_bytes launch over every plane of every copy, then one
    dequantize / reconstruct launch per tensor and copy) and allocates nothing."""

    def __init__(self, p: plans.Plan, data: torch.Tensor, copies: int):
        self.p, self.data, self.copies = p, data, copies
        self.planes, desc = quant.byte_planes(p)
        first, numel = plans.DESC_FIELDS.index("first_segment"), plans.DESC_FIELDS.index("numel")
        self.n_segments = sum(pl.n_segments for pl in self.planes)
        rows = []
        for k in range(copies):
            d = desc.clone()
            d[:, first] += k * self.n_segments
            rows.append(d)
        self.desc = torch.cat(rows).contiguous() if self.planes else desc
        self.status = torch.zeros(max(copies * self.n_segments, 1), dtype=torch.int32, device=data.device)
        self.tensors = [{e.name: torch.empty(e.shape, dtype=e.torch_dtype, device=data.device)
                         for e, _ in p.coded_entries} for _ in range(copies)]
        self.decoded = []                                             # per copy: {name: {role: plane}}
        for k in range(copies):
            by_entry: dict[str, dict[str, torch.Tensor]] = {}
            for pl, row in zip(self.planes, desc.tolist()):
                out = (raw(self.tensors[k][pl.entry.name]) if pl.entry.codec == CODEC_FLOAT   # fp8: its tensor
                       else torch.empty(row[numel], dtype=torch.uint8, device=data.device))
                by_entry.setdefault(pl.entry.name, {})[pl.role] = out
            self.decoded.append(by_entry)
        self.outputs = [self.decoded[k][pl.entry.name][pl.role] for k in range(copies) for pl in self.planes]
        self.finish = [self._finisher(k, e, offsets) for k in range(copies) for e, offsets in p.coded_entries]
        self.finish = [f for f in self.finish if f is not None] + self._gguf_finishers()
        self.output_bytes = copies * sum(e.nbytes for e, _ in p.coded_entries)

    def _plane(self, k: int, e, offsets, role: str) -> torch.Tensor:
        got = self.decoded[k].get(e.name, {})
        return got[role] if role in got else self.data[offsets[role]:offsets[role] + e.streams[role]["length"]]

    def _gguf_finishers(self) -> list:
        """As cuda_ext/quant.py: one dequantize_blocks call per block type and dtype, over every copy."""
        groups: dict[tuple, tuple[list, list]] = {}
        for k in range(self.copies):
            for e, offsets in self.p.coded_entries:
                if e.codec == CODEC_GGUF:
                    planes, outs = groups.setdefault((e.params.block.code, e.torch_dtype), ([], []))
                    planes += [self._plane(k, e, offsets, r) for r in e.params.block.plane_names]
                    outs.append(self.tensors[k][e.name])
        return [lambda code=code, planes=planes, outs=outs: ops.dequantize_blocks(planes, code, outs)
                for (code, _), (planes, outs) in groups.items()]

    def _finisher(self, k: int, e, offsets):
        out = self.tensors[k][e.name]
        if e.codec == CODEC_INT8:
            args = [self._plane(k, e, offsets, r) for r in ("resid", "modes", "scales")]
            return lambda: ops.reconstruct_int8(args[0], args[1], args[2].view(torch.float32), out)
        return None                                                   # fp8: decode_bytes wrote it; GGUF: grouped

    def run(self) -> None:
        self.run_bytes()
        self.run_finish()

    def run_bytes(self) -> None:
        """The first step alone: every coded plane of every copy (rANS)."""
        if self.planes:
            ops.decode_bytes(self.data, self.desc, self.outputs, self.status)

    def run_finish(self) -> None:
        """The second step alone: dequantize / reconstruct each tensor of each copy."""
        for f in self.finish:
            f()


def bench_archive(tag: str, path: Path, copies: int, repeat: int) -> dict:
    with Archive.open(path) as archive:
        entries = [e for e in archive.entries if is_new_codec(e)]
        p = plans.build(entries, archive.path)
        host = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    data = host.to(DEVICE)
    t0 = time.perf_counter()
    cpu = cuda_ext.decode_plan(p, host, path)                         # the C++ twin
    cpu_s = time.perf_counter() - t0
    gpu = cuda_ext.decode_plan(p, data, path)
    exact = all(torch.equal(raw(gpu[e.name]).cpu(), raw(cpu[e.name])) for e in entries)
    job = Copies(p, data, copies)
    seconds = timed(job.run, repeat)
    steps = {"decode_bytes_s": timed(job.run_bytes, repeat), "finish_s": timed(job.run_finish, repeat)}
    statuses_ok = int(job.status.abs().sum()) == 0
    copies_exact = all(torch.equal(raw(job.tensors[k][e.name]), raw(gpu[e.name]))
                       for k in (0, copies - 1) for e in entries)
    one = timed(lambda: cuda_ext.decode_plan(p, data, path), max(3, repeat // 2))
    kinds = sorted({e.params.block.name if e.codec == CODEC_GGUF else e.codec if e.codec == CODEC_INT8 else e.dtype
                    for e in entries})
    row = {"codec": tag, "tensors": len(entries), "kinds": kinds, "copies": copies,
           "output_bytes": job.output_bytes, "stream_bytes": p.end - p.start,
           "seconds": seconds, "GBps": job.output_bytes / seconds / 1e9, **steps,
           "decode_plan_one_copy_GBps": job.output_bytes / copies / one / 1e9,
           "cpu_twin_GBps": job.output_bytes / copies / cpu_s / 1e9,
           "bit_exact_vs_twin": exact and copies_exact, "statuses_ok": statuses_ok}
    row["pass"] = row["bit_exact_vs_twin"] and statuses_ok and row["GBps"] >= TARGET_GBPS
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", type=Path, help="a demo GGUF part (scripts/gguf_subset.py) whose blocks to decode")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--copies", type=int, default=8, help="layer copies decoded per timed launch")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--only", nargs="*", help="codec tags to run (default: all)")
    args = ap.parse_args()
    avail = cuda_ext.available()
    if not avail.cuda or not ops.has_quant_ops("cuda"):
        print(f"needs the CUDA kernels of the quantized codecs: {avail}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, torch {torch.__version__}, decoder {avail.path}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        archives = build_archives(Path(tmp), args.part, args.workers)
        for tag, path in archives.items():
            if args.only and tag not in args.only:
                continue
            row = bench_archive(tag, path, args.copies, args.repeat)
            rows.append(row)
            print(f"{tag:10s} {row['GBps']:8.1f} GB/s of output ({row['copies']} x {row['output_bytes'] // row['copies'] / 1e6:.0f} MB,"
                  f" {row['kinds']}; steps: decode_bytes {row['decode_bytes_s'] * 1e3:.2f} ms,"
                  f" finish {row['finish_s'] * 1e3:.2f} ms); one copy through decode_plan {row['decode_plan_one_copy_GBps']:.1f} GB/s;"
                  f" C++ twin {row['cpu_twin_GBps']:.2f} GB/s; bit-exact {row['bit_exact_vs_twin']},"
                  f" statuses ok {row['statuses_ok']} -> {'PASS' if row['pass'] else 'FAIL'}", flush=True)
            torch.cuda.empty_cache()
    result = {"device": props.name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "target_GBps": TARGET_GBPS, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if rows and all(r["bit_exact_vs_twin"] and r["statuses_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
