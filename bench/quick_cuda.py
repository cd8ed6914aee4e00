"""First timing of the CUDA decoder on bf16 weights (no peers): GB/s of decoded output."""
import sys
import time

import torch

import cuda_ext
from codec.decode import Archive
from codec.encode import compress_state_dict
from cuda_ext import plans


def main(path="/tmp/quick.wcodec", layers=2):
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 4096)] * 4 + [(11008, 4096), (4096, 11008), (11008, 4096)]
    state = {f"model.layers.{i}.w{j}": (torch.randn(s, generator=g, device="cuda") * 0.02).bfloat16().cpu()
             for i in range(layers) for j, s in enumerate(shapes)}
    t = time.perf_counter()
    st = compress_state_dict(state, path, workers=16)
    print(f"encode {st.raw_bytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f}s, ratio {st.ratio:.4f}")
    with Archive.open(path) as a:
        p = plans.build(a.entries, a.path)
        data = torch.from_numpy(a.reader.buf[p.start:p.end].copy()).cuda()
    out = cuda_ext.decode_plan(p, data)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(10):
        ev[0].record()
        cuda_ext.decode_plan(p, data)
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]) / 1e3)
    times.sort()
    exact = all(torch.equal(out[k].cpu().view(torch.int16), v.view(torch.int16)) for k, v in state.items())
    print(f"decode {st.raw_bytes / times[len(times) // 2] / 1e9:.1f} GB/s median of 10 "
          f"(best {st.raw_bytes / times[0] / 1e9:.1f}), {p.n_segments} segments, bit-exact {exact}")
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    ev[0].record(); y.copy_(x); ev[1].record(); torch.cuda.synchronize()
    print(f"device copy ceiling {2 * x.numel() / (ev[0].elapsed_time(ev[1]) / 1e3) / 1e12:.2f} TB/s (read+write)")


if __name__ == "__main__":
    main(layers=int(sys.argv[1]) if len(sys.argv) > 1 else 2)
