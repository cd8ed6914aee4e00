"""A quick timing of the CUDA decoder (no peers) for scripts/device_check.sh: N Llama-7B layers of
random bf16 decoded in one launch, and the device-copy ceiling. The full run is gpu_bench.py.

    python bench/quick_cuda.py [N_LAYERS]
"""
import sys
import tempfile
from pathlib import Path

import torch
from gpu_bench import Ours, ceilings, layer_shapes, timed, weights

import cuda_ext


def main(layers: int = 2) -> None:
    state = weights(layer_shapes(layers), seed=0)
    ours = Ours(state, Path(tempfile.mkdtemp(prefix="wcodec-quick-")), "quick")
    print(f"encode {ours.raw / 1e9:.2f} GB in {ours.encode_s:.1f}s, ratio {ours.stats.ratio:.4f}")
    seconds = timed(lambda: cuda_ext.decode_plan(ours.plan, ours.data))
    out = cuda_ext.decode_plan(ours.plan, ours.data)
    exact = all(out[k].cpu().view(torch.int16).equal(v.view(torch.int16)) for k, v in state.items())
    print(f"decode {ours.raw / seconds / 1e9:.1f} GB/s median of 10, {ours.plan.n_segments} segments, bit-exact {exact}")
    print(f"device copy ceiling {ceilings()['d2d_copy_TBps']:.2f} TB/s (read+write)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
