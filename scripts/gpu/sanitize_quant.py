"""A small run of every quantized-codec CUDA kernel for `compute-sanitizer --tool memcheck`:

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu/sanitize_quant.py

decode_bytes (fp8 planes and GGUF block planes), dequantize_blocks (Q4_1, Q8_0, Q4_K; bf16, f16,
f32) and reconstruct_int8 (ragged tiles; aligned and unaligned tensors) on valid inputs, checked
against the C++ twin; then 24 corrupt copies of the archive bytes (random flips, anywhere), each
decoded on the GPU, which must raise CorruptStreamError or give the twin's bits. Exits non-zero if
a decode differs from the twin."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]                # the repo (this file is in scripts/gpu/)
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cuda_ext  # noqa: E402
import quant_gpu  # noqa: E402  (bench/quant_gpu.py: inputs and the blocks source)
from codec import errors, gguf_blocks  # noqa: E402
from codec.decode import Archive  # noqa: E402
from codec.encode import compress_source  # noqa: E402
from codec.sources import StateDictSource  # noqa: E402
from cuda_ext import ops, plans  # noqa: E402


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def small_archive(path: Path) -> Path:
    """fp8 weights (one with 2 segments and a tail), GGUF blocks of three types, an int8 weight."""
    quant_gpu.DEVICE = "cpu"
    g = torch.Generator().manual_seed(0)
    w = quant_gpu.trained_like((80, 4096), g)                          # 327680 weights: 2.5 segments
    fp8, _ = quant_gpu.fp8_cast(w, torch.float8_e4m3fn)
    small = quant_gpu.trained_like((40, 256), g)
    blocks = {f"model.layers.1.{kind}": (gguf_blocks.Blocks(gguf_blocks.BLOCK_TYPES[kind], q(w).numpy()),
                                         tuple(w.shape), torch.bfloat16)
              for kind, q in quant_gpu.QUANTIZERS.items()}
    with quant_gpu.BlocksSource(blocks) as source:
        compress_source(source, path.with_suffix(".gguf.wcodec"), workers=2)
    state = {"model.layers.0.fp8": fp8, "model.layers.0.e5m2": quant_gpu.fp8_cast(small, torch.float8_e5m2)[0],
             "model.layers.2.int8": quant_gpu.trained_like((70, 300), g).to(torch.bfloat16)}
    with StateDictSource(state) as source:
        compress_source(source, path, workers=2, lossy="int8")
    return path


def decode_both(path: Path) -> tuple[plans.Plan, torch.Tensor, dict, dict]:
    with Archive.open(path) as archive:
        p = plans.build(archive.entries, archive.path)
        host = torch.from_numpy(archive.reader.buf[p.start:p.end].copy())
    return p, host, cuda_ext.decode_plan(p, host, path), cuda_ext.decode_plan(p, host.cuda(), path)


def direct_ops() -> bool:
    """dequantize_blocks and reconstruct_int8 on every byte pattern, unaligned views included."""
    ok = True
    for kind in ("Q4_1", "Q8_0", "Q4_K"):
        bt = gguf_blocks.BLOCK_TYPES[kind]
        blocks = np.random.default_rng(1).integers(0, 256, (4096 // bt.block_size + 3, bt.type_size), dtype=np.uint8)
        planes = [torch.from_numpy(np.ascontiguousarray(v)) for v in gguf_blocks.split(bt, blocks).values()]
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            cpu = torch.empty(len(blocks) * bt.block_size, dtype=dtype)
            gpu = torch.empty(len(blocks) * bt.block_size + 1, dtype=dtype, device="cuda")[1:]
            ops.dequantize_blocks(planes, bt.code, [cpu])
            ops.dequantize_blocks([torch.cat([torch.zeros(1, dtype=torch.uint8), p]).cuda()[1:] for p in planes],
                                  bt.code, [gpu])
            ok &= torch.equal(raw(gpu), raw(cpu))
    rng = np.random.default_rng(2)
    rows, cols = 37, 53
    resid = torch.from_numpy(rng.integers(0, 256, rows * cols, dtype=np.uint8))
    modes = torch.from_numpy(rng.integers(0, 5, 3 * 4, dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(0, 1 << 32, rows, dtype=np.uint64).astype(np.uint32)).view(torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cpu = torch.empty(rows, cols, dtype=dtype)
        ops.reconstruct_int8(resid, modes, scales, cpu)
        gpu = torch.empty(rows * cols + 1, dtype=dtype, device="cuda")[1:].view(rows, cols)
        ops.reconstruct_int8(resid.cuda(), modes.cuda(), scales.cuda(), gpu)
        ok &= torch.equal(raw(gpu), raw(cpu))
    return ok


def main() -> int:
    assert cuda_ext.available().cuda and ops.has_quant_ops("cuda"), cuda_ext.available()
    ok, caught, silent = True, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        path = small_archive(Path(tmp) / "q.wcodec")
        for archive in (path, path.with_suffix(".gguf.wcodec")):
            p, host, cpu, gpu = decode_both(archive)
            ok &= all(torch.equal(raw(gpu[k]), raw(v)) for k, v in cpu.items())
            g = torch.Generator().manual_seed(3)
            for trial in range(12):                                 # corrupt copies: flips anywhere
                bad = host.clone()
                at = torch.randint(0, host.numel(), (4,), generator=g)
                bad[at] ^= torch.randint(1, 255, (4,), generator=g, dtype=torch.uint8)
                try:
                    got = cuda_ext.decode_plan(p, bad.cuda(), archive)
                except errors.CorruptStreamError:
                    caught += 1
                    continue
                try:
                    want = cuda_ext.decode_plan(p, bad, archive)
                except errors.CorruptStreamError:
                    ok = False                                          # the twin saw what the GPU missed
                    continue
                silent += 1                                             # flips in raw planes, padding, scales
                ok &= all(torch.equal(raw(got[k]), raw(v)) for k, v in want.items())
    ok &= direct_ops()
    torch.cuda.synchronize()
    print(f"quantized kernels {'ok' if ok else 'WRONG'}; corrupt copies: {caught} raised, {silent} decoded as the twin")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
